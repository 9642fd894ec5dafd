"""Widths one config's towers hand each other, derived so that a shrunk composite config's
towers still fit (issue 65; used by :mod:`.consistent`): each rule reads what the configs state
(a field's relation to another's), never a family's name."""
from __future__ import annotations

import math


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def width_of(level: dict, main_keys) -> int | None:
    """A level's main width: the first of ``main_keys`` it states as a positive int."""
    return next((level[k] for k in main_keys if is_int(level.get(k)) and level[k] > 0), None)


def concatenated(old_fields: dict, sub: dict, k: str, old, main_keys) -> int | None:
    """A sub-config's output width that is its width times one more than a list of layer indices
    it states (those layers' states joined to the last one's: Mllama's ``vision_output_dim``
    7680 = 1280 × (1 + 5 ``intermediate_layers_indices``)): the shrunk width times one more
    than the shrunk list's length; None for any other."""
    w_old, w_new = width_of(old_fields, main_keys), width_of(sub, main_keys)
    if not (is_int(old) and w_old and w_new and {"out", "output"} & set(k.split("_"))):
        return None
    for f, layers in old_fields.items():
        kept = sub.get(f)
        if "layers" in f.split("_") and isinstance(layers, (list, tuple)) and layers \
                and all(is_int(x) for x in layers) and old == w_old * (1 + len(layers)) \
                and isinstance(kept, (list, tuple)):
            return w_new * (1 + len(kept))
    return None


def image_token(fields) -> bool:
    return any(is_int(fields.get(k)) for k in ("image_token_id", "image_token_index"))


def merged_widths(fields, out, main_keys) -> dict:
    """A width of a composite config that states no width of its own (so none is scaled) and
    is a whole multiple of exactly one sub-config's width: that multiple of the shrunk width
    (MuseGlimmer's ``out_hidden_size`` 6144 is its 1536-wide vision tower's features with
    2 × 2 patches merged: 4 × the shrunk 64); a width no sub-config divides is left alone."""
    if width_of(fields, main_keys) is not None:
        return {}
    subs = {k: (width_of(vars(fields[k]), main_keys), width_of(v, main_keys)) for k, v in out.items()
            if isinstance(v, dict) and k.endswith("_config") and hasattr(fields.get(k), "to_dict")}
    res = {}
    for k, v in fields.items():
        t = k.split("_")
        if not (is_int(v) and t[-1] in ("size", "dim") and {"hidden", "out", "output"} & set(t)
                and "token" not in t and k not in out):
            continue
        found = [(v // old, new) for old, new in subs.values()
                 if is_int(old) and is_int(new) and old > new and v % old == 0 and v // old <= 16]
        if len(found) == 1:
            res[k] = found[0][0] * found[0][1]
    return res


STAGE_WIDTH = 256  # the last stage's shrunk width where a level's width is one per stage


def stage_widths(fields, main) -> dict:
    """A level that states its width as one per stage (Florence 2's DaViT ``embed_dim``
    [128, 256, 512, 1024]), so that no width of its own is scaled: every stage's divided by one
    factor, the last to :data:`STAGE_WIDTH` (their ratios, and the head and group counts that
    divide them, kept); a list the factor does not divide is left alone."""
    v = fields.get("embed_dim")
    if main is not None or not (isinstance(v, (list, tuple)) and len(v) > 1 and all(is_int(x) for x in v)):
        return {}
    f = v[-1] // STAGE_WIDTH
    if f < 2 or any(x % f for x in v):
        return {}
    return {"embed_dim": type(v)(x // f for x in v)}


def multiplied_channels(fields, main, width) -> dict:
    """The channel counts of a convolutional encoder whose stages' widths a list of multipliers
    states (``channel_multiplier``: Apertus 1.5's vision tokenizer, ``base_channels`` 256 × (1, 1,
    2, 2, 4) a stage, its ``latent_channels`` 256 into a codebook of ``embed_dim`` 256): widths,
    scaled as the level's main width goes from ``main`` to ``width`` (a multiple of 8), but none
    below ``width`` (the model code normalises them in groups of a literal count: Emu3's VQ-VAE
    ``GroupNorm(num_groups=32)``, whose 256 base channels would become 16 beside its width 1024 ->
    64); the image's channels (``in_channels`` 3, a latent of 4: at most 8) are none."""
    multiplied = any("channel" in k and "multiplier" in k and isinstance(v, (list, tuple)) for k, v in fields.items())
    if not (multiplied and is_int(main) and is_int(width) and 0 < width < main):
        return {}
    return {k: max(width, int(round(v * width / main / 8)) * 8) for k, v in fields.items()
            if k.endswith("_channels") and is_int(v) and width < v}


QUERY_TOKENS = 64  # image tokens a row at most: a tower's learned queries (Kosmos-2's default)


def query_tokens(fields) -> dict:
    """A count of learned queries whose outputs take as many token positions in each row of
    text (``latent_query_num``, ``num_query_tokens``: Kosmos-2.5's 2048): at most
    :data:`QUERY_TOKENS`, so that the example's rows stay short."""
    return {k: QUERY_TOKENS for k in ("latent_query_num", "num_query_tokens")
            if is_int(fields.get(k)) and fields[k] > QUERY_TOKENS}


def patch_pixels(fields, out) -> dict:
    """A patch embedding's input width (``patch_embed_hidden_size``: one patch's ``C·P·P``
    pixels as the image processor flattens them, Pix2Struct's 3 × 16 × 16 = 768) that the
    shrink changed because it equalled the model's width: kept, since it is the input's width
    (``C`` the level's channels, 3 unless stated), not the model's."""
    ch = fields.get("num_channels") if is_int(fields.get("num_channels")) else 3
    res = {}
    for k, v in fields.items():
        t = set(k.split("_"))
        if "patch" in t and {"hidden", "embed"} & t and k.split("_")[-1] in ("size", "dim") and is_int(v) \
                and k in out and out[k] != v and ch > 0 and v % ch == 0 and math.isqrt(v // ch) ** 2 == v // ch:
            res[k] = v
    return res


def patch_queries(fields, out) -> dict:
    """A map from an image's patch count to the learned queries its projector pools it into (a
    dict of counts whose name says patch and query: Aria's ``projector_patch_to_query_dict``
    ``{1225: 128, 4900: 256}``, 490- and 980-pixel images of 14-pixel patches), keyed by the
    patches of the shrunk vision config's image (``(image / patch)²``), as many queries as patches
    (at most the fewest it stated): an image of the shrunk size finds its patch count there, as
    a real checkpoint's image of its own size does (its projector refuses any other count)."""
    vision = out.get("vision_config") or {}
    image, patch = vision.get("image_size"), vision.get("patch_size")
    if not (is_int(image) and is_int(patch) and 0 < patch <= image):
        return {}
    n = (image // patch) ** 2
    res = {}
    for k, v in fields.items():
        t = set(k.split("_"))
        if not ({"patch", "query"} <= t and isinstance(v, dict) and v):
            continue
        try:
            counts = {int(a): int(b) for a, b in v.items()}
        except (TypeError, ValueError):
            continue
        if n not in counts and min(counts.values()) > 0:
            res[k] = {n: min(n, min(counts.values()))}
    return res


def aliased_token_ids(cfg, fields, free: int | None) -> dict:
    """A token id the config stores under a name of its own, which its ``attribute_map`` gives
    a token id's name (Molmo2's ``image_token_id`` and ``video_token_id`` are ``image_patch_id``
    151938), so that the shrink rule's renumbering by name missed it: at or past ``free`` (beyond
    the shrunk vocabulary), stated in the shrunk config as ``free``, ``free - 1``, ... (the
    model would embed past its vocabulary, and text could hold no image)."""
    amap = getattr(type(cfg), "attribute_map", None) if cfg is not None else None
    if not (is_int(free) and isinstance(amap, dict)):
        return {}
    names = sorted({t for a, t in amap.items() if a.endswith(("_token_id", "_token_index"))
                    and not t.endswith(("_token_id", "_token_index")) and is_int(fields.get(t))})
    res: dict = {}
    for t in names:
        if fields[t] >= free:
            res[t] = free - len(res)
    return res

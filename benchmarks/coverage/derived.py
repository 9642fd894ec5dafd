"""Sizes the shrink rule derives across a composite's levels: the widths one tower hands another,
token ids and ranges the model code reads, a detector's backbone sizes, and
:func:`derived_sizes`, every derived size of one level (with those of :mod:`.consistent`)."""
from __future__ import annotations

import re

from .consistent import (all_shared, divided_widths, int_list, is_int, layout_parts, model_source,
                         multiplied_channels, multipliers, new_value, patch_pixels, stage_depths, stage_widths,
                         width_of)


# --- a composite's towers -----------------------------------------------------------------------


def tower_widths(fields, out, main_keys) -> dict:
    """Widths one sub-config hands another, equal in real checkpoints though transformers' default
    composites may state them apart (Qwen3-ASR's audio ``output_dim`` 3584 beside a 2048-wide text):

    * beside a ``text_config``, an output width (``dim``/``size`` named ``out`` or ``output``) at
      least the text's default width: the text's shrunk width (a smaller one is a head of its own);
    * a ``<name>_hidden_size`` beside a ``<name>_config``: that config's width;
    * an output width joining a list of layers' states (:func:`concatenated`);
    * with an image token, the vision config's ``projection_dim``: the text's width;

    and the composite's own (:func:`merged_widths`)."""
    subs = {k: v for k, v in out.items() if isinstance(v, dict) and k.endswith("_config")}
    text_old = width_of(vars(fields["text_config"]), main_keys) if "text_config" in subs else None
    text_new = width_of(subs.get("text_config", {}), main_keys)
    image_token = any(is_int(fields.get(k)) for k in ("image_token_id", "image_token_index"))
    res = {}
    for name, sub in subs.items():
        new = {}
        for k, v in sub.items():
            t = k.split("_")
            old = vars(fields[name]).get(k)  # not getattr: a per-layer field refuses a global read
            joined = concatenated(vars(fields[name]), sub, k, old, main_keys)
            if joined is not None:
                new[k] = joined
            elif name != "text_config" and text_new and is_int(old) and text_old and old >= text_old \
                    and {"out", "output"} & set(t) and t[-1] in ("dim", "size"):
                new[k] = text_new
            elif t[-2:] == ["hidden", "size"] and len(t) > 2 and "_".join(t[:-2]) + "_config" in subs:
                width = width_of(subs["_".join(t[:-2]) + "_config"], main_keys)
                new.update({k: width} if width and v != width else {})
            elif name == "vision_config" and k == "projection_dim" and text_new and is_int(v) and image_token:
                new[k] = text_new
        if any(sub.get(k) != v for k, v in new.items()):
            res[name] = {**sub, **new}
    return {**res, **merged_widths(fields, out, main_keys)}


def concatenated(old_fields: dict, sub: dict, k: str, old, main_keys) -> int | None:
    """An output width of the width times one more than a list of layer indices (Mllama's
    ``vision_output_dim``): so for the shrunk width and list; None for any other."""
    w_old, w_new = width_of(old_fields, main_keys), width_of(sub, main_keys)
    if not (is_int(old) and w_old and w_new and {"out", "output"} & set(k.split("_"))):
        return None
    for f, layers in old_fields.items():
        if "layers" in f.split("_") and int_list(layers) and old == w_old * (1 + len(layers)) \
                and isinstance(sub.get(f), (list, tuple)):
            return w_new * (1 + len(sub[f]))
    return None


def _sub_widths(fields, out, main_keys) -> dict:
    """``{name: (default width, shrunk width)}`` of each shrunk sub-config."""
    return {k: (width_of(vars(fields[k]), main_keys), width_of(v, main_keys)) for k, v in out.items()
            if isinstance(v, dict) and hasattr(fields.get(k), "to_dict")}


def merged_widths(fields, out, main_keys) -> dict:
    """A width of a composite with no width of its own that is a whole multiple (≤ 16) of exactly
    one sub-config's width (MuseGlimmer's merged patches): that multiple of the shrunk width."""
    if width_of(fields, main_keys) is not None:
        return {}
    subs = {k: w for k, w in _sub_widths(fields, out, main_keys).items() if k.endswith("_config")}
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


def stream_widths(fields, out, main_keys) -> dict:
    """Beside a ``text_config``, a vision output hidden width below the text's default width but at
    least the tower's own (what its merger writes into the text stream: Qwen3-VL's): the text's."""
    text_cfg, vision = fields.get("text_config"), out.get("vision_config")
    if text_cfg is None or not isinstance(vision, dict) or fields.get("vision_config") is None:
        return {}
    text_old, text_new = width_of(vars(text_cfg), main_keys), width_of(out.get("text_config") or {}, main_keys)
    old_fields = vars(fields["vision_config"])
    own_old = width_of(old_fields, main_keys)
    if not (text_old and text_new and own_old):
        return {}
    new = {}
    for k, v in vision.items():
        t, old = k.split("_"), old_fields.get(k)
        if {"out", "output"} & set(t) and "hidden" in t and t[-1] in ("dim", "size") and is_int(old) \
                and own_old <= old < text_old and v != text_new:
            new[k] = text_new
    return {"vision_config": {**vision, **new}} if new else {}


def rotary_widths(fields, out, main_keys, heads: int | None, head_dim: int) -> dict:
    """With rotary parameters, a head count and no ``head_dim``, a second main width (Qwen2-VL's
    vision ``embed_dim``) the head count divides into heads of at least ``head_dim``: ``heads × head_dim``."""
    rope = fields.get("rope_parameters")
    main = next((k for k in main_keys if is_int(fields.get(k)) and fields[k] > 0), None)
    old_heads = [v for k, v in fields.items() if k in ("num_heads", "num_attention_heads") and is_int(v) and v > 0]
    if not (isinstance(rope, dict) and rope and heads and old_heads and main) or is_int(fields.get("head_dim")):
        return {}
    res = {}
    for k in main_keys:
        v = fields.get(k)
        if is_int(v) and k != main and v % old_heads[0] == 0 and v // old_heads[0] >= head_dim \
                and out.get(k, v) != heads * head_dim:
            res[k] = heads * head_dim
    return res


def handed_channels(fields, out, main_keys) -> dict:
    """A sub-config's list of channels ending in another (non-text) sub-config's default width
    (Unlimited-OCR's SAM ``downsample_channels``): scaled to end in its shrunk width."""
    subs = {k: v for k, v in out.items() if isinstance(v, dict) and hasattr(fields.get(k), "to_dict")}
    widths = _sub_widths(fields, out, main_keys)
    res = {}
    for name, sub in subs.items():
        new = {}
        for k, v in sub.items():
            if k in main_keys or not int_list(v, positive=True):
                continue
            to = [w for other, w in widths.items() if other not in (name, "text_config") and w[0] == v[-1]
                  and is_int(w[1])]
            if len(to) == 1 and to[0][1] != v[-1] and all(x * to[0][1] % to[0][0] == 0 for x in v):
                new[k] = type(v)(x * to[0][1] // to[0][0] for x in v)
        if new:
            res[name] = {**sub, **new}
    return res


def layer_ids(fields, out, role) -> dict:
    """A ``..._layer_id`` (MiniCPM-V's ``insert_layer_id``) past the shrunk stack: scaled with the
    main layer count; a composite's own, its sub-config's shrunk one."""
    main = next((k for k, v in fields.items() if role(k) == "layers_main" and is_int(v) and v > 0), None)
    old, new = (fields[main], out.get(main, fields[main])) if main else (None, None)
    if not (is_int(old) and is_int(new) and 0 < new < old):
        subs = [v for v in out.values() if isinstance(v, dict)]
        return {k: min(found) for k, v in fields.items() if k.split("_")[-2:] == ["layer", "id"] and is_int(v)
                and len(found := {s[k] for s in subs if is_int(s.get(k)) and s[k] != v}) == 1}
    return {k: min(new - 1, v * new // old) for k, v in fields.items()
            if k.split("_")[-2:] == ["layer", "id"] and is_int(v) and new <= v < old}


def tokens_per_image(fields, out) -> dict:
    """Image tokens per image at most the patches of the shrunk vision image (Gemma 3 pools them)."""
    vision = out.get("vision_config") or {}
    image, patch = vision.get("image_size"), vision.get("patch_size")
    if not (is_int(image) and is_int(patch) and patch > 0):
        return {}
    side = max(1, image // patch)
    return {k: side * side for k in ("mm_tokens_per_image", "image_seq_length")
            if is_int(fields.get(k)) and fields[k] > side * side}


def grid_pinpoints(fields, out) -> dict:
    """``image_grid_pinpoints`` (multiples of the vision image size) as multiples of the shrunk one."""
    v, vision = fields.get("image_grid_pinpoints"), out.get("vision_config") or {}
    new_size, old_size = vision.get("image_size"), getattr(fields.get("vision_config"), "image_size", None)
    if not (isinstance(v, (list, tuple)) and v and is_int(new_size) and is_int(old_size)) or new_size == old_size:
        return {}
    if not all(isinstance(p, (list, tuple)) and all(is_int(x) and x % old_size == 0 for x in p) for p in v):
        return {}
    return {"image_grid_pinpoints": [[x // old_size * new_size for x in p] for p in v]}


QUERY_TOKENS = 64  # image tokens a row at most: a tower's learned queries (Kosmos-2's default)


def query_tokens(fields) -> dict:
    """Learned queries each taking a token position (Kosmos-2.5's 2048): at most :data:`QUERY_TOKENS`."""
    return {k: QUERY_TOKENS for k in ("latent_query_num", "num_query_tokens")
            if is_int(fields.get(k)) and fields[k] > QUERY_TOKENS}


def patch_queries(fields, out) -> dict:
    """A map from a patch count to a projector's queries (Aria's ``projector_patch_to_query_dict``)
    keyed by the shrunk vision image's patches (the projector refuses other counts)."""
    vision = out.get("vision_config") or {}
    image, patch = vision.get("image_size"), vision.get("patch_size")
    if not (is_int(image) and is_int(patch) and 0 < patch <= image):
        return {}
    n = (image // patch) ** 2
    res = {}
    for k, v in fields.items():
        if not ({"patch", "query"} <= set(k.split("_")) and isinstance(v, dict) and v):
            continue
        try:
            counts = {int(a): int(b) for a, b in v.items()}
        except (TypeError, ValueError):
            continue
        if n not in counts and min(counts.values()) > 0:
            res[k] = {n: min(n, min(counts.values()))}
    return res


# --- token ids and ranges -----------------------------------------------------------------------


def query_image_tokens(fields, out, free_id: int) -> dict:
    """An image (video) token left None beside ``num_query_tokens`` (BLIP-2's): ``free_id``."""
    if not is_int(new_value(fields, out, "num_query_tokens")):
        return {}
    return {k: free_id for k in ("image_token_index", "video_token_index") if k in fields and fields[k] is None}


def sliding_window(fields, window: int) -> dict:
    """A ``sliding_window`` left None where another field names sliding attention: ``window``."""
    named = any("sliding" in k and k != "sliding_window" and v not in (None, False, 0) for k, v in fields.items())
    return {"sliding_window": window} if "sliding_window" in fields and fields["sliding_window"] is None \
        and named else {}


def _token_ids(d: dict) -> set:
    """Every token id stated in ``d`` and its sub-config dicts."""
    ids: set = set()
    for k, v in d.items():
        if isinstance(v, dict):
            ids |= _token_ids(v)
        elif isinstance(k, str) and k.endswith(("_token_id", "_token_index", "_token_ids")):
            ids |= {x for x in (v if isinstance(v, (list, tuple)) else [v]) if is_int(x)}
    return ids


_PLACEHOLDERS = {"vision_config": ("image_token_id", "image_token_index", "video_token_id", "video_token_index"),
                 "audio_config": ("audio_token_id", "audio_token_index")}


def placeholder_tokens(fields, out, vocab: int) -> dict:
    """An image (video, audio) token left None beside its tower's config (MiniCPM-V 4.6's,
    Voxtral's: the forward skips the tower without one): the highest free ids below ``vocab``."""
    names = [k for sub, keys in _PLACEHOLDERS.items() if fields.get(sub) is not None
             for k in keys if k in fields and fields[k] is None and out.get(k) is None]
    if not names:
        return {}
    stated = {k: v for k, v in fields.items() if not hasattr(v, "to_dict")}
    used = _token_ids({**stated, **out}) | {x for k, v in fields.items() if hasattr(v, "to_dict")
                                             for x in _token_ids(v.to_dict())}
    free = [i for i in range(vocab - 1, -1, -1) if i not in used][:len(names)]
    return dict(zip(names, free))


def aliased_token_ids(cfg, fields, free: int | None) -> dict:
    """A token id under a name ``attribute_map`` gives a token id's name (Molmo2's
    ``image_patch_id``) at or past ``free``: ``free``, ``free - 1``, ..."""
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


def code_token_ids(cfg, fields, free: int | None) -> dict:
    """Token ids the model code reads with a default the config does not declare (ShieldGemma 2's
    ``yes_token_index``) at or past ``free``: ``free``, ``free - 1``, ..."""
    if not is_int(free):
        return {}
    found = re.findall(r"""getattr\(\s*config\s*,\s*["'](\w+_token_(?:id|index))["']\s*,\s*([\d_]+)\s*\)""",
                       model_source(cfg))
    res: dict = {}
    for key, default in found:
        if key not in fields and key not in res and int(default) >= free:
            res[key] = free - len(res)
    return res


CODEBOOK = 16  # a shrunk tokenizer's codebook: its codes are the argmax of this many logits


def _levels(fields: dict, out: dict):
    """``(name, old fields, shrunk dict)`` for the level itself (name None) and each sub-config."""
    yield None, fields, out
    for k, v in fields.items():
        if hasattr(v, "to_dict") and isinstance(out.get(k), dict):
            yield k, vars(v), out[k]


def code_ranges(fields: dict, out: dict, top: int | None = None) -> dict:
    """Ranges of codes (each ``..._token_offset`` a ``codebook_size`` long, end to end in the text
    vocabulary: Apertus 1.5's) kept end to end: each codebook at most :data:`CODEBOOK`, the first at
    its default's share, all below ``top`` (the lowest renumbered id; None: the vocabulary's end)."""
    offsets = {k: v for k, v in fields.items() if is_int(v) and v > 0
               and k.endswith("_offset") and "token" in k.split("_")}
    vocabs = [(name, old["vocab_size"], new.get("vocab_size", old["vocab_size"]))
              for name, old, new in _levels(fields, out) if is_int(old.get("vocab_size")) and old["vocab_size"] > 0]
    if not offsets or len(vocabs) != 1 or vocabs[0][1] <= vocabs[0][2]:
        return {}
    _, old_vocab, vocab = vocabs[0]
    books = {(name, k): v for name, old, _ in _levels(fields, out) for k, v in old.items()
             if k == "codebook_size" and is_int(v) and v > 0}
    order, chain = sorted(offsets, key=offsets.get), []
    for i, k in enumerate(order):  # each range ends where the next begins, the last within the vocabulary
        end = offsets[order[i + 1]] if i + 1 < len(order) else None
        fits = [b for b, c in books.items() if b not in {x for _, x in chain}
                and (offsets[k] + c == end if end is not None else offsets[k] + c <= old_vocab)]
        if len(fits) != 1:
            return {}
        chain.append((k, fits[0]))
    sizes = {b: min(books[b], CODEBOOK) for _, b in chain}
    start = offsets[chain[0][0]] * vocab // old_vocab
    start = min(start, min(vocab if top is None else top, vocab) - sum(sizes.values()))
    if start < 0:
        return {}
    res: dict = {}
    for k, (name, field) in chain:
        res[k] = start
        start += sizes[(name, field)]
        if name is None:
            res[field] = sizes[(name, field)]
        else:
            res[name] = {**res.get(name, out[name]), field: sizes[(name, field)]}
    return res


# --- a detector's backbone ----------------------------------------------------------------------


def feature_widths(fields, out) -> dict:
    """A width named ``feat`` that the shrink changed whose default is a backbone stage's channels
    (PP-DocLayout V3's ``x4_feat_dim``): that stage's shrunk channels."""
    old_bb, new_bb = fields.get("backbone_config"), out.get("backbone_config")
    if not (hasattr(old_bb, "to_dict") and isinstance(new_bb, dict)):
        return {}

    def stages(d):  # the backbone's channels per stage (stage_out_channels, hidden_sizes)
        return {k: list(v) for k, v in d.items() if int_list(v)
                and ("channels" in k.split("_") and "out" in k.split("_") or k == "hidden_sizes")}
    old, new = stages(vars(old_bb)), stages(new_bb)
    res = {}
    for k, v in out.items():
        d = fields.get(k)
        if "feat" not in k.split("_") or not (is_int(v) and is_int(d)) or v == d:
            continue
        found = {new[name][old[name].index(d)] for name in old
                 if d in old[name] and len(new.get(name, ())) == len(old[name])}
        if len(found) == 1:
            res[k] = found.pop()
    return res


def object_queries(fields, out) -> dict:
    """``num_queries`` at most the patches of the backbone's shrunk image (RF-DETR's proposals)."""
    q, bb = fields.get("num_queries"), out.get("backbone_config")
    image, patch = (bb.get("image_size"), bb.get("patch_size")) if isinstance(bb, dict) else (None, None)
    if not (is_int(q) and is_int(image) and is_int(patch) and patch > 0 and image >= patch):
        return {}
    most = (image // patch) ** 2
    return {"num_queries": most} if q > most else {}


def derived_sizes(fields, out, main, width, cfg, free: int | None) -> dict:
    """The sizes derived on a level whose main width goes from ``main`` to ``width``; token ids the
    model code reads numbered down from ``free``."""
    code = code_token_ids(cfg, fields, free)
    aliased = aliased_token_ids(cfg, fields, free - len(code) if free is not None else None)
    return {**layout_parts(fields, main, width), **stage_depths(fields, out), **aliased,
            **multipliers(fields, main, width), **code, **all_shared(fields, out),
            **stage_widths(fields, main), **multiplied_channels(fields, main, width),
            **divided_widths(cfg, fields, out), **query_tokens(fields),
            **patch_pixels(fields, out), **code_ranges(fields, out, free)}

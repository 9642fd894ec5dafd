"""Widths of a vision-language composite's towers that the shrink rule keeps consistent beyond
:func:`.consistent.tower_widths` (issue 65): the width a vision tower writes into the text stream
and the width a rotary tower's heads divide. Each rule reads what the config states (a field's
name and default, a head count, rotary parameters), never a family's name."""
from __future__ import annotations

from .consistent import tower_widths
from .tower_sizes import is_int, patch_queries, width_of


def tower_rules(fields, out, main_keys, heads: int | None, head_dim: int, vocab: int, role=None) -> dict:
    """:func:`.consistent.tower_widths`, then :func:`stream_widths`, :func:`rotary_widths`,
    :func:`placeholder_tokens`, :func:`handed_channels`, :func:`layer_ids` and
    :func:`.tower_sizes.patch_queries` on what it leaves
    (one dict of overrides of the level); ``role``: the shrink rule's role of a field's name."""
    res = tower_widths(fields, out, main_keys)
    res.update(layer_ids(fields, out, role) if role is not None else {})
    res.update(stream_widths(fields, {**out, **res}, main_keys))
    res.update(rotary_widths(fields, {**out, **res}, main_keys, heads, head_dim))
    res.update(placeholder_tokens(fields, {**out, **res}, vocab))
    res.update(handed_channels(fields, {**out, **res}, main_keys))
    res.update(patch_queries(fields, {**out, **res}))
    return res


def layer_ids(fields, out, role) -> dict:
    """A layer named by its index in a field ``..._layer_id`` (MiniCPM-V's vision
    ``insert_layer_id`` 6: the layer after which its ViT merger runs) past the shrunk stack:
    scaled with the main layer count, so that layer exists (a merger after no layer is never
    read); an index within the stack is kept. A composite that states it too (and hands its own
    to the sub-config: MiniCPM-V's) states the sub-config's shrunk one."""
    main = next((k for k, v in fields.items() if role(k) == "layers_main" and is_int(v) and v > 0), None)
    old, new = (fields[main], out.get(main, fields[main])) if main else (None, None)
    if not (is_int(old) and is_int(new) and 0 < new < old):
        subs = [v for v in out.values() if isinstance(v, dict)]
        return {k: min(found) for k, v in fields.items() if k.split("_")[-2:] == ["layer", "id"] and is_int(v)
                and len(found := {s[k] for s in subs if is_int(s.get(k)) and s[k] != v}) == 1}
    return {k: min(new - 1, v * new // old) for k, v in fields.items()
            if k.split("_")[-2:] == ["layer", "id"] and is_int(v) and new <= v < old}


def handed_channels(fields, out, main_keys) -> dict:
    """A list of channel counts in one sub-config whose last entry is another sub-config's default
    width (Unlimited-OCR's SAM ``downsample_channels`` [512, 1024] end in its CLIP encoder's 1024:
    the SAM features become the encoder's patch embeddings): scaled as that width, to end in its
    shrunk width (the shrink rule leaves other lists of widths alone). A list named as a main
    width, and the text's width (:func:`.consistent.tower_widths`' concern), are not this rule's."""
    subs = {k: v for k, v in out.items() if isinstance(v, dict) and hasattr(fields.get(k), "to_dict")}
    widths = {k: (width_of(vars(fields[k]), main_keys), width_of(v, main_keys)) for k, v in subs.items()}
    res = {}
    for name, sub in subs.items():
        new = {}
        for k, v in sub.items():
            if k in main_keys or not (isinstance(v, (list, tuple)) and v and all(is_int(x) and x > 0 for x in v)):
                continue  # a tower's own widths per stage (Florence 2's DaViT ``embed_dim``) are its own
            to = [w for other, w in widths.items() if other not in (name, "text_config") and w[0] == v[-1]
                  and is_int(w[1])]
            if len(to) == 1 and to[0][1] != v[-1] and all(x * to[0][1] % to[0][0] == 0 for x in v):
                new[k] = type(v)(x * to[0][1] // to[0][0] for x in v)
        if new:
            res[name] = {**sub, **new}
    return res


def _token_ids(d: dict) -> set:
    """Every token id stated in ``d`` and in its sub-config dicts."""
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
    """An image (video) token a composite with a ``vision_config`` declares and leaves None
    (``image_token_id``, ``video_token_id``: MiniCPM-V 4.6's and 4.7's, MiniCPM-OCR's, whose
    processors take them from the tokenizer's placeholder), an audio token beside an
    ``audio_config`` (Voxtral's): the forward skips the tower without one, so the model could
    read no image (audio) at all; real checkpoints state it (Voxtral Mini's audio token is 24).
    The shrunk config's: the highest ids below ``vocab`` that no other token of the config
    takes, one each."""
    names = [k for sub, keys in _PLACEHOLDERS.items() if fields.get(sub) is not None
             for k in keys if k in fields and fields[k] is None and out.get(k) is None]
    if not names:
        return {}
    stated = {k: v for k, v in fields.items() if not hasattr(v, "to_dict")}
    used = _token_ids({**stated, **out}) | {x for k, v in fields.items() if hasattr(v, "to_dict")
                                             for x in _token_ids(v.to_dict())}
    free = [i for i in range(vocab - 1, -1, -1) if i not in used][:len(names)]
    return dict(zip(names, free))


def stream_widths(fields, out, main_keys) -> dict:
    """Beside a ``text_config``, a vision sub-config's output width (``out_hidden_size``: a
    hidden ``dim``/``size`` named ``out`` or ``output``) smaller than the text's default width but at
    least the tower's own default width is what its merger writes into the text stream at the
    image tokens' places: the text's shrunk width. transformers' default composites state the
    two apart (Qwen3-VL's and Cosmos3-Omni's vision ``out_hidden_size`` 3584 beside a 4096-wide
    text, GLM-5-Next's 1536 beside 4096) while the model scatters the features into the text's
    embeddings, and real checkpoints state them equal; a wider output is
    :func:`.consistent.tower_widths`' and a narrower one than the tower's own width a head of
    its own (left alone)."""
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
    """On a level with rotary parameters, a head count and no ``head_dim``, a second main width
    (``embed_dim`` beside ``hidden_size``: Qwen2-VL's vision tower, 1280 wide in 16 heads of 80,
    beside the 3584 it writes to the text) whose default the head count divides into heads of at
    least ``head_dim``: ``heads × head_dim``. Scaled by the level's main width it becomes 24, six
    per head, and the tower's 2-D rotary embedding (a quarter of each head's width per axis, in
    pairs) no longer fits its heads."""
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

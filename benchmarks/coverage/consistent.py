"""Sizes the shrink rule derives from others so that a shrunk config passes its own validators
and its model's shape checks (issue 65): each rule reads what the config states (a field, a
list's relation to another field), never a family's name."""
from __future__ import annotations

from .code_divisors import divided_widths
from .token_ranges import code_ranges
from .tower_sizes import (aliased_token_ids, concatenated, image_token, is_int, merged_widths, multiplied_channels,
                          patch_pixels, query_tokens, stage_widths, width_of)


def _new(fields, out, k):
    """A field's shrunk value (its default where the rule left it)."""
    return out.get(k, fields.get(k))


def head_width(fields, out, width, heads):
    """A level's shrunk width per attention head: its ``head_dim`` when it states one, else its
    shrunk width over its shrunk head count (as transformers' rotary code derives it)."""
    hd = _new(fields, out, "head_dim")
    if is_int(hd) and hd > 0:
        return hd
    return width // heads if width and heads else None


def kept_layers(fields, old, new, role, kinds: bool = False) -> list | None:
    """The layers a shrunk config keeps (None: all): the first ``new``, unless a list with one
    kind per layer (``layer_types``, ``mlp_layer_types``: strings or flags) would lose a kind
    (OLMo-Hybrid's validator wants an attention layer among its linear ones): then the fewest
    layers that hold every kind of every such list (greedy: the layer with the most kinds still
    missing, the first on ties), and the first others up to ``new``, in order.
    ``kinds`` False: the first ``new`` layers."""
    if not (is_int(old) and is_int(new) and 0 < new < old):
        return None
    if not kinds:
        return list(range(new))
    lists = [v for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == old
             and role(k) is None and all(isinstance(x, (str, bool)) for x in v)]
    need = {(j, kind) for j, v in enumerate(lists) for kind in v}
    chosen: set = set()
    while need:  # greedy cover: the layer holding the most kinds still missing, the first on ties
        best = max(range(old), key=lambda i: (sum((j, v[i]) in need for j, v in enumerate(lists)), -i))
        chosen.add(best)
        need -= {(j, v[best]) for j, v in enumerate(lists)}
    rest = [i for i in range(old) if i not in chosen]
    return sorted(chosen | set(rest[:max(0, new - len(chosen))]))


def partition(fields, old, new, role):
    """The new main layer count when qualified counts partition the old one (Dory's input,
    recurrent and output layers sum to ``num_hidden_layers``): their shrunk sum (each -> 1)."""
    parts = [v for k, v in fields.items() if role(k) == "layers_other" and is_int(v) and v >= 0]
    if not (is_int(old) and is_int(new) and len(parts) > 1 and sum(parts) == old):
        return new
    return min(old, sum(min(v, 1) for v in parts))


def repeats(v, old, new):
    """A list of ``[kinds, times]`` pairs that spells one kind per layer (GPT-Neo's
    ``attention_types`` [[["global", "local"], 12]] for 24 layers), its times scaled so that it
    spells ``new`` layers; None when it is no such list or cannot."""
    if not (is_int(old) and is_int(new) and 0 < new < old and v):
        return None
    pairs = [x for x in v if isinstance(x, (list, tuple)) and len(x) == 2
             and isinstance(x[0], (list, tuple)) and x[0] and is_int(x[1]) and x[1] > 0]
    if len(pairs) != len(v) or sum(len(k) * n for k, n in pairs) != old:
        return None
    out = [[list(k), max(1, n * new // old)] for k, n in pairs]
    return type(v)(out) if sum(len(k) * n for k, n in out) == new else None


def windows(fields, out) -> dict:
    """A windowed vision level's ``window_size`` no larger than the patch grid of its last stage
    (Swin's shrunk image / patch / 2^(stages - 1)): its attention's position bias is built for
    the window, while a stage smaller than the window attends to the whole stage."""
    w, image, patch, depths = (_new(fields, out, k) for k in ("window_size", "image_size", "patch_size",
                                                                "depths"))
    if not (is_int(w) and is_int(image) and is_int(patch) and patch > 0
            and isinstance(depths, (list, tuple)) and depths):
        return {}
    last = max(1, image // patch // 2 ** (len(depths) - 1))
    return {"window_size": last} if w > last else {}


def per_count(name, v, counts) -> int:
    """The new length of a list with one entry per layer of a qualified layer count named
    alike (Speech2Text's ``conv_kernel_sizes`` beside ``num_conv_layers``), else 0."""
    own = set(name.lower().split("_")) - {"num", "n", "layers", "layer", "size", "sizes"}
    for k, (old, new) in counts.items():
        if len(v) == old and own & (set(k.lower().split("_")) - {"num", "n", "layers", "layer"}):
            return new
    return 0


def head_dim_sums(fields, out, role) -> dict:
    """A head width that is the sum of two others named within it (DeepSeek-style attention's
    ``qk_head_dim`` = ``qk_nope_head_dim`` + ``qk_rope_head_dim``, when declared): the sum of
    their shrunk values."""
    dims = {k: v for k, v in fields.items() if role(k) == "head_dim" and is_int(v) and v > 0}
    res = {}
    for k, v in dims.items():
        own = set(k.split("_"))
        if not own - {"head", "dim", "size"}:
            continue  # a plain head_dim names no parts
        parts = [(a, b) for a in dims for b in dims if a < b and k not in (a, b)
                 and dims[a] + dims[b] == v and own <= set(a.split("_")) & set(b.split("_"))]
        if len(parts) == 1:
            a, b = parts[0]
            res[k] = _new(fields, out, a) + _new(fields, out, b)
    return res


def split_to(old, total: int) -> list:
    """``old`` (positive ints) scaled to ``total`` by largest remainders (the first on ties, so
    equal entries stay equal where the total allows: ERNIE-VL stacks its equal height and width
    sections), each at least 1."""
    s = sum(old)
    exact = [x * total / s for x in old]
    new = [max(1, int(e)) for e in exact]
    order = sorted(range(len(old)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    k = 0
    while sum(new) < total:
        new[order[k % len(old)]] += 1
        k += 1
    while sum(new) > total:  # entries raised to 1: taken back from the largest
        new[max(range(len(new)), key=lambda i: (new[i], -i))] -= 1
    return new


def mrope_sections(cfg, fields, out, width, heads) -> dict:
    """Multimodal rotary sections (``rope_parameters["mrope_section"]``: time, height, width) that
    must sum to half the rotary width per head: scaled to the shrunk one. Set where the config
    states a section or its class names ``mrope_section`` among its rope keys (a model that
    reads its own default: Qwen2-VL's [16, 24, 24] sums to 64 = 128 / 2), or, on a level with a
    vocabulary, its family's model code reads one with a default of its own (PaddleOCR-VL's
    ``rope_parameters.get("mrope_section", [16, 24, 24])``, which its config names nowhere)."""
    rp = _new(fields, out, "rope_parameters")
    if not isinstance(rp, dict) or not rp or any(isinstance(x, dict) for x in rp.values()):
        return {}  # none, or one per layer type
    names = getattr(type(cfg), "ignore_keys_at_rope_validation", None) or ()
    code = "vocab_size" in fields and read_with_default(cfg, "mrope_section")  # a text level's
    if "mrope_section" not in rp and "mrope_section" not in names and not code:
        return {}
    rope = _new(fields, out, "qk_rope_head_dim")
    head = rope if is_int(rope) and rope > 0 else head_width(fields, out, width, heads)
    factor = rp.get("partial_rotary_factor") or fields.get("partial_rotary_factor") or 1.0
    if not head:
        return {}
    total = int(head * factor) // 2
    old = rp.get("mrope_section")
    old = list(old) if isinstance(old, (list, tuple)) and old and all(is_int(x) and x > 0 for x in old) \
        else [1, 1, 1]
    if total < len(old) or sum(old) == total and "mrope_section" in rp:
        return {}
    return {"rope_parameters": {**rp, "mrope_section": split_to(old, total)}}


def read_with_default(cfg, key: str) -> bool:
    """Whether the model code of ``cfg``'s family (the ``modeling_`` module beside its config's
    ``configuration_`` one) reads ``key`` from a dict with a default (``.get("key", ...)``)."""
    import importlib
    import inspect
    import re
    name = type(cfg).__module__
    if ".configuration_" not in name:
        return False
    try:
        code = inspect.getsource(importlib.import_module(name.replace(".configuration_", ".modeling_")))
    except Exception:  # noqa: BLE001 - no such module, or no source: nothing read
        return False
    return re.search(r"""\.get\(\s*["']%s["']\s*,""" % re.escape(key), code) is not None


def state_head_dims(fields, out, width, role) -> dict:
    """A state-space level's head width, derived so that heads × head width = expand × width
    (the validators of Mamba 2, Bamba, Falcon-H1): for each ``...expand`` field, the one head
    count and the one head width named with the same prefix (``mamba_n_heads``,
    ``mamba_d_head`` beside ``mamba_expand``; ``num_heads``, ``head_dim`` beside ``expand``).
    A state width stated beside them (Falcon-H1's ``mamba_d_ssm``, shrunk as a width) replaces
    expand × width."""
    res: dict = {}
    for k, e in fields.items() if width else ():
        pre = k[:-len("expand")]
        if not (k.endswith("expand") and is_int(e) and e > 0):
            continue
        heads = [h for h in fields if h.startswith(pre) and role(h) == "heads"]
        dims = [h for h in fields if h.startswith(pre) and role(h) == "head_dim"]
        n = out.get(heads[0], fields[heads[0]]) if len(heads) == 1 and len(dims) == 1 else None
        states = [_new(fields, out, h) for h in fields if h.startswith(pre) and "ssm" in h.split("_")
                  and role(h) == "width" and is_int(_new(fields, out, h))]
        inner = states[0] if len(states) == 1 else e * width
        if is_int(n) and n > 0 and inner % n == 0:
            res[dims[0]] = inner // n
    return res


def tokens_per_image(fields, out) -> dict:
    """A vision-language level's image tokens per image (``mm_tokens_per_image``,
    ``image_seq_length``) as a square no larger than the patches of its vision config's shrunk
    image (Gemma 3 pools ``image/patch`` patches a side down to ``√tokens``: 256 tokens from a
    64-pixel image of 14-pixel patches would pool with a kernel of 0)."""
    vision = out.get("vision_config")
    image, patch = (vision or {}).get("image_size"), (vision or {}).get("patch_size")
    if not (is_int(image) and is_int(patch) and patch > 0):
        return {}
    side = max(1, image // patch)
    res = {}
    for k in ("mm_tokens_per_image", "image_seq_length"):
        v = fields.get(k)
        if is_int(v) and v > side * side:
            res[k] = side * side
    return res


def query_image_tokens(fields, out, free_id: int) -> dict:
    """An image (video) token left None beside query tokens (``num_query_tokens``: BLIP-2's,
    InstructBLIP's): the forward puts each query's output at a token of that id, so a config
    without one cannot take text (real checkpoints state it); the shrunk config's is
    ``free_id``, the highest id no other token takes."""
    if not is_int(_new(fields, out, "num_query_tokens")):
        return {}
    return {k: free_id for k in ("image_token_index", "video_token_index") if k in fields and fields[k] is None}


def sliding_window(fields, window: int) -> dict:
    """A ``sliding_window`` left None on a level that names sliding attention in another field
    (Step3p7's ``num_sliding_attention_heads``: its forward builds the sliding mask whatever
    its layer types; a flag that turns it off, Qwen2's ``use_sliding_window=False``, names none):
    the shrunk window ``window``."""
    named = any("sliding" in k and k != "sliding_window" and v not in (None, False, 0) for k, v in fields.items())
    return {"sliding_window": window} if "sliding_window" in fields and fields["sliding_window"] is None \
        and named else {}


def feature_layers(fields, out) -> dict:
    """The vision tower's layers a level reads features from (``vision_feature_layer``: one
    index or a list, VipLLaVA's five), each within the shrunk tower's hidden states (its layers
    and the embeddings' output: ``-(L + 1) .. L``); a list keeps its length, which the
    projector's width counts."""
    layers = (out.get("vision_config") or {}).get("num_hidden_layers")
    if not is_int(layers) or layers < 1:
        return {}
    res = {}
    for k, v in fields.items():
        if "feature" not in k or "layer" not in k or not (is_int(v) or isinstance(v, (list, tuple)) and v
                                                          and all(is_int(x) for x in v)):
            continue
        clamp = [max(-(layers + 1), min(layers, x)) for x in ([v] if is_int(v) else v)]
        new = clamp[0] if is_int(v) else type(v)(clamp)
        if new != v:
            res[k] = new
    return res


def layer_spans(fields, old: int | None, new: int | None) -> dict:
    """Fields that point at layers of the main stack or count them in blocks (Inkling 2's loop
    over ``loop_layer_index_start .. _end``, ``n_layers_per_attn_res_block``) scaled with the
    layer count from ``old`` to ``new`` layers: an index within ``0 .. new``, a count per block
    within ``1 .. new`` (a positive index stays positive, an end is rounded up: the span stays
    non-empty); a loop past the shrunk stack would leave its layers unread."""
    if not (is_int(old) and is_int(new)) or old <= new:
        return {}
    res = {}
    for k, v in fields.items():
        toks = k.split("_")
        if not is_int(v) or not {"layer", "layers"} & set(toks) or v > old:
            continue
        if "index" in toks:
            x = -(-v * new // old) if "end" in toks else v * new // old
            res[k] = max(1 if v > 0 else 0, min(new, x))
        elif toks[:3] == ["n", "layers", "per"]:
            res[k] = max(1, min(new, v * new // old))
    return {k: v for k, v in res.items() if v != fields[k]}


def grid_pinpoints(fields, out) -> dict:
    """The resolutions a high-resolution image is tiled at (``image_grid_pinpoints``, multiples
    of the vision tower's image size: LLaVA-NeXT's 336 × (1, 2, 3)) as the same multiples of
    the shrunk image size."""
    v, vision = fields.get("image_grid_pinpoints"), out.get("vision_config") or {}
    new_size, old_size = vision.get("image_size"), getattr(fields.get("vision_config"), "image_size", None)
    if not (isinstance(v, (list, tuple)) and v and is_int(new_size) and is_int(old_size)) or new_size == old_size:
        return {}
    if not all(isinstance(p, (list, tuple)) and all(is_int(x) and x % old_size == 0 for x in p) for p in v):
        return {}
    return {"image_grid_pinpoints": [[x // old_size * new_size for x in p] for p in v]}


def tower_widths(fields, out, main_keys) -> dict:
    """Widths one sub-config hands another, kept equal when both are shrunk. transformers'
    default composites do not always state them equal (Qwen3-ASR's audio ``output_dim`` 3584 is
    Qwen2.5-Omni-7B's text width, beside a 2048-wide text config; Granite Speech's Q-Former
    ``encoder_hidden_size`` 1408 is BLIP-2's vision width, beside a 1024-wide encoder), but
    the models' code needs them equal and real checkpoints state them so. Two rules, by name:

    * beside a ``text_config``, a sub-config's output width (a ``dim``/``size`` named ``out`` or
      ``output``) at least the text's default width is what the tower writes into the text
      stream (Qwen3-ASR, Qwen3-Omni's audio and vision): the text's shrunk width. A smaller
      one is a head of its own (Granite Speech's 42 CTC classes) and left alone;
    * a ``<name>_hidden_size`` in a sub-config beside a ``<name>_config`` is that config's
      width (Granite Speech's projector reads its ``encoder_config``'s states);
    * a sub-config's output width that joins the states of a list of its layers to the last
      one's is its width times one more than that list's length (:func:`.tower_sizes.concatenated`);
    * in a config with an image token, the vision config's ``projection_dim`` is the width of
      the features that take the image tokens' places in the text (Janus' aligner, Florence 2's
      projector; transformers' Janus default states 2048 beside a 4096-wide text): the text's.

    Widths of the composite's own (a level with no width of its own) are in
    :func:`.tower_sizes.merged_widths`.
    """
    subs = {k: v for k, v in out.items() if isinstance(v, dict) and k.endswith("_config")}
    text_old = width_of(vars(fields["text_config"]), main_keys) if "text_config" in subs else None
    text_new = width_of(subs.get("text_config", {}), main_keys)
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
            elif name == "vision_config" and k == "projection_dim" and text_new and is_int(v) \
                    and image_token(fields):
                new[k] = text_new
        if any(sub.get(k) != v for k, v in new.items()):
            res[name] = {**sub, **new}
    return {**res, **merged_widths(fields, out, main_keys)}


def derived_sizes(fields, out, main, width, cfg=None, free: int | None = None) -> dict:
    """The sizes below, derived on a level whose main width goes from ``main`` to ``width``;
    token ids its model code reads with defaults of its own numbered down from ``free``."""
    code = code_token_ids(cfg, fields, free)
    aliased = aliased_token_ids(cfg, fields, free - len(code) if free is not None else None)
    return {**layout_parts(fields, main, width), **stage_depths(fields, out), **aliased,
            **multipliers(fields, main, width), **code, **all_shared(fields, out),
            **stage_widths(fields, main), **multiplied_channels(fields, main, width),
            **divided_widths(cfg, fields, out), **query_tokens(fields),
            **patch_pixels(fields, out), **code_ranges(fields, out, free)}


def all_shared(fields, out) -> dict:
    """A count of layers that share another's key-value cache (``num_kv_shared_layers``) that
    is every layer by default (Gemma 4's unified assistant: all 30 read the target model's
    cache; its validator refuses a layer kind that one layer makes and none other reads):
    every shrunk layer."""
    main = next((k for k in ("num_hidden_layers", "num_layers") if is_int(fields.get(k))), None)
    new = out.get(main) if main else None
    if not is_int(new):
        return {}
    return {k: new for k, v in fields.items() if is_int(v) and v == fields[main] and v > new
            and "shared" in k.split("_") and k.endswith("_layers")}


def code_token_ids(cfg, fields, free: int | None) -> dict:
    """Token ids the family's model code reads from the config with a default of its own that
    the config does not declare (ShieldGemma 2's ``getattr(config, "yes_token_index", 10_784)``,
    a logit it selects): each default at or past ``free`` (beyond the shrunk vocabulary) stated
    in the shrunk config as ``free``, ``free - 1``, ... (a model would index past its logits)."""
    import importlib
    import inspect
    import re
    name = type(cfg).__module__ if cfg is not None else ""
    if not is_int(free) or ".configuration_" not in name:
        return {}
    try:
        code = inspect.getsource(importlib.import_module(name.replace(".configuration_", ".modeling_")))
    except Exception:  # noqa: BLE001 - no such module, or no source: nothing read
        return {}
    found = re.findall(r"""getattr\(\s*config\s*,\s*["'](\w+_token_(?:id|index))["']\s*,\s*([\d_]+)\s*\)""", code)
    res: dict = {}
    for key, default in found:
        if key not in fields and key not in res and int(default) >= free:
            res[key] = free - len(res)
    return res


def layout_parts(fields, main, width) -> dict:
    """A layout embedding's parts (``coordinate_size`` for each of a box's four coordinates,
    ``shape_size`` for its height and width: LayoutLMv3 concatenates them into the width, 4 ×
    128 + 2 × 128 = 768), where the defaults fill the width so: shrunk to fill the shrunk one."""
    c, s = fields.get("coordinate_size"), fields.get("shape_size")
    if not (is_int(c) and is_int(s) and is_int(main) and is_int(width) and 4 * c + 2 * s == main
            and width != main and width % 2 == 0 and width >= 6):
        return {}
    c = width // 6
    return {"coordinate_size": c, "shape_size": (width - 4 * c) // 2}


def stage_depths(fields, out) -> dict:
    """A per-stage depth list whose default stage ``i`` holds more than ``i`` layers (CvT's
    ``depth`` [1, 2, 10]: its stage ``i`` reads its drop-path rates, one per layer, at index
    ``i``) keeps that when shrunk: ``min(default, i + 1)`` layers at stage ``i``."""
    res = {}
    for k, v in out.items():
        old = fields.get(k)
        if not (isinstance(v, (list, tuple)) and isinstance(old, (list, tuple)) and len(v) == len(old) > 1
                and all(is_int(x) for x in (*v, *old)) and "depth" in k.split("_")):
            continue
        if all(x > i for i, x in enumerate(old)) and any(x <= i for i, x in enumerate(v)):
            res[k] = type(v)(max(x, min(o, i + 1)) for i, (x, o) in enumerate(zip(v, old)))
    return res


def multipliers(fields, main, width) -> dict:
    """Channel and depth multipliers of a scaled convolutional family (EfficientNet's
    ``width_coefficient``, by which every stage's channels and its last convolution's 1280 are
    multiplied, so its main width ``hidden_dim`` 2560 is 1280 × 2.0; ``depth_coefficient``, by
    which every stage's blocks are): the width multiplier scaled as the main width, the depth
    multiplier at most 1."""
    res: dict = {}
    w, d = fields.get("width_coefficient"), fields.get("depth_coefficient")
    if isinstance(w, float) and is_int(main) and is_int(width) and width < main:
        res["width_coefficient"] = w * width / main
    if isinstance(d, float) and d > 1.0 and res:
        res["depth_coefficient"] = 1.0
    return res

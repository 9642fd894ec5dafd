"""Sizes the shrink rule (:mod:`.shrink`) derives from others within one level, so that a shrunk
config passes its validators and its model's shape checks: the layers kept, head and state sizes,
widths stated as parts, multiples or divisors of the main one (across levels: :mod:`.derived`).
Each rule reads what the config states (a field's name and default, its relation to another
field, the model code transformers ships), never a family's name. ``fields``: a level's default
fields; ``out``: its shrunk overrides (sub-configs as dicts)."""
from __future__ import annotations

import importlib
import inspect
import math
import re


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_list(v, positive: bool = False) -> bool:
    """Whether ``v`` is a non-empty list or tuple of ints (each > 0 when ``positive``)."""
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(x) and (x > 0 or not positive) for x in v)


def new_value(fields, out, k):
    """A field's shrunk value (its default where the rule left it)."""
    return out.get(k, fields.get(k))


def width_of(level: dict, main_keys) -> int | None:
    """A level's main width: the first of ``main_keys`` it states as a positive int."""
    return next((level[k] for k in main_keys if is_int(level.get(k)) and level[k] > 0), None)


def model_source(cfg) -> str:
    """The source of the ``modeling_`` module beside ``cfg``'s ``configuration_`` one; "" if none."""
    name = type(cfg).__module__ if cfg is not None else ""
    if ".configuration_" not in name:
        return ""
    try:
        return inspect.getsource(importlib.import_module(name.replace(".configuration_", ".modeling_")))
    except Exception:  # noqa: BLE001 - no such module, or no source: nothing read
        return ""


# --- layers -------------------------------------------------------------------------------------


def kept_layers(fields, old, new, role, kinds: bool = False) -> list | None:
    """The layers a shrunk config keeps (None: all): the first ``new``; with ``kinds``, first the
    fewest that hold every kind of each list with one kind per layer (greedy: OLMo-Hybrid's validator
    wants an attention layer among its linear ones), then the first others, in order."""
    if not (is_int(old) and is_int(new) and 0 < new < old):
        return None
    if not kinds:
        return list(range(new))
    lists = [v for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == old
             and role(k) is None and all(isinstance(x, (str, bool)) for x in v)]
    need = {(j, kind) for j, v in enumerate(lists) for kind in v}
    chosen: set = set()
    while need:
        best = max(range(old), key=lambda i: (sum((j, v[i]) in need for j, v in enumerate(lists)), -i))
        chosen.add(best)
        need -= {(j, v[best]) for j, v in enumerate(lists)}
    rest = [i for i in range(old) if i not in chosen]
    return sorted(chosen | set(rest[:max(0, new - len(chosen))]))


def partition(fields, old, new, role):
    """The main layer count when qualified counts sum to it (Dory's): their shrunk sum (each -> 1)."""
    parts = [v for k, v in fields.items() if role(k) == "layers_other" and is_int(v) and v >= 0]
    if not (is_int(old) and is_int(new) and len(parts) > 1 and sum(parts) == old):
        return new
    return min(old, sum(min(v, 1) for v in parts))


def repeats(v, old, new):
    """A list of ``[kinds, times]`` pairs spelling one kind per layer (GPT-Neo's ``attention_types``)
    scaled to spell ``new`` layers; None if it is none or cannot."""
    if not (is_int(old) and is_int(new) and 0 < new < old and v):
        return None
    pairs = [x for x in v if isinstance(x, (list, tuple)) and len(x) == 2
             and isinstance(x[0], (list, tuple)) and x[0] and is_int(x[1]) and x[1] > 0]
    if len(pairs) != len(v) or sum(len(k) * n for k, n in pairs) != old:
        return None
    out = [[list(k), max(1, n * new // old)] for k, n in pairs]
    return type(v)(out) if sum(len(k) * n for k, n in out) == new else None


def per_count(name, v, counts) -> int:
    """The new length of a list with one entry per layer of a qualified count named alike, else 0."""
    own = set(name.lower().split("_")) - {"num", "n", "layers", "layer", "size", "sizes"}
    for k, (old, new) in counts.items():
        if len(v) == old and own & (set(k.lower().split("_")) - {"num", "n", "layers", "layer"}):
            return new
    return 0


def layer_spans(fields, old: int | None, new: int | None) -> dict:
    """Indices into the main stack and layers per block (Inkling 2's loop) scaled from ``old`` to
    ``new`` layers, a span kept non-empty."""
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


def all_shared(fields, out) -> dict:
    """A ``..._shared_..._layers`` count that is every layer by default (Gemma 4's assistant): every shrunk one."""
    main = next((k for k in ("num_hidden_layers", "num_layers") if is_int(fields.get(k))), None)
    new = out.get(main) if main else None
    if not is_int(new):
        return {}
    return {k: new for k, v in fields.items() if is_int(v) and v == fields[main] and v > new
            and "shared" in k.split("_") and k.endswith("_layers")}


def stage_depths(fields, out) -> dict:
    """A per-stage depth list whose default stage ``i`` has more than ``i`` layers (CvT's: stage ``i``
    reads its drop-path rates at index ``i``): at least ``min(default, i + 1)`` layers at stage ``i``."""
    res = {}
    for k, v in out.items():
        old = fields.get(k)
        if not (int_list(v) and int_list(old) and len(v) == len(old) > 1 and "depth" in k.split("_")):
            continue
        if all(x > i for i, x in enumerate(old)) and any(x <= i for i, x in enumerate(v)):
            res[k] = type(v)(max(x, min(o, i + 1)) for i, (x, o) in enumerate(zip(v, old)))
    return res


def feature_layers(fields, out) -> dict:
    """The vision layers a level reads features from (``vision_feature_layer``: an index or a list),
    each within the shrunk tower's hidden states ``-(L + 1) .. L``."""
    layers = (out.get("vision_config") or {}).get("num_hidden_layers")
    if not is_int(layers) or layers < 1:
        return {}
    res = {}
    for k, v in fields.items():
        if "feature" not in k or "layer" not in k or not (is_int(v) or int_list(v)):
            continue
        clamp = [max(-(layers + 1), min(layers, x)) for x in ([v] if is_int(v) else v)]
        new = clamp[0] if is_int(v) else type(v)(clamp)
        if new != v:
            res[k] = new
    return res


# --- widths and heads ---------------------------------------------------------------------------


def head_dim_sums(fields, out, role) -> dict:
    """A head width summing two named within it (``qk_head_dim``): the sum of their shrunk values."""
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
            res[k] = new_value(fields, out, a) + new_value(fields, out, b)
    return res


def group_heads(fields, out, role) -> dict:
    """A count of heads within one key/value group (Kolibri 1.1's ``index_num_heads``: leading
    query heads of key head 0, at most 48 / 4 = 12 by default): another heads field at most the
    query heads per key/value head by default stays at most the shrunk ones (4 / 2 = 2)."""
    heads = {k: v for k, v in fields.items() if role(k) == "heads" and is_int(v) and v > 0}
    kv = [k for k, v in fields.items() if role(k) == "kv_heads" and is_int(v) and v > 0]
    if not heads or not kv:
        return {}
    # the attention's own pair where named so (Qwen3-Next's linear-attention heads are others)
    q = "num_attention_heads" if "num_attention_heads" in heads else max(heads, key=heads.get)
    kv_key = "num_key_value_heads" if "num_key_value_heads" in kv else \
        next((k for k in kv if heads[q] % fields[k] == 0), None)
    if kv_key is None or heads[q] % fields[kv_key]:
        return {}
    if not is_int(new_value(fields, out, q)) or not is_int(new_value(fields, out, kv_key)):
        return {}
    per_old, per_new = heads[q] // fields[kv_key], new_value(fields, out, q) // new_value(fields, out, kv_key)
    return {k: per_new for k, v in heads.items()
            if k != q and v <= per_old < heads[q] and new_value(fields, out, k) > per_new > 0}


def split_to(old, total: int) -> list:
    """``old`` (positive ints) scaled to ``total`` by largest remainders, the first on ties (equal
    entries stay equal where the total allows), each at least 1."""
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
    """Multimodal rotary sections (``rope_parameters["mrope_section"]``), which sum to half the
    rotary width per head: split to the shrunk one, where the config states them, its class names
    them among its rope keys or a text level's model code reads them with a default (PaddleOCR-VL's)."""
    rp = new_value(fields, out, "rope_parameters")
    if not isinstance(rp, dict) or not rp or any(isinstance(x, dict) for x in rp.values()):
        return {}  # none, or one per layer type
    names = getattr(type(cfg), "ignore_keys_at_rope_validation", None) or ()
    code = "vocab_size" in fields and read_with_default(cfg, "mrope_section")
    if "mrope_section" not in rp and "mrope_section" not in names and not code:
        return {}
    rope, hd = new_value(fields, out, "qk_rope_head_dim"), new_value(fields, out, "head_dim")
    head = rope if is_int(rope) and rope > 0 else hd if is_int(hd) and hd > 0 else \
        width // heads if width and heads else None
    factor = rp.get("partial_rotary_factor") or fields.get("partial_rotary_factor") or 1.0
    if not head:
        return {}
    total = int(head * factor) // 2
    old = rp.get("mrope_section")
    old = list(old) if int_list(old, positive=True) else [1, 1, 1]
    if total < len(old) or sum(old) == total and "mrope_section" in rp:
        return {}
    return {"rope_parameters": {**rp, "mrope_section": split_to(old, total)}}


def read_with_default(cfg, key: str) -> bool:
    """Whether ``cfg``'s model code (:func:`model_source`) reads ``key`` by ``.get("key", default)``."""
    return re.search(r"""\.get\(\s*["']%s["']\s*,""" % re.escape(key), model_source(cfg)) is not None


def state_head_dims(fields, out, width, role) -> dict:
    """A state-space head width such that heads × head width = expand × width (Mamba 2's validator),
    for each ``...expand`` and the head count and width of its prefix; a state width stated beside
    them (Falcon-H1's ``mamba_d_ssm``) replaces expand × width."""
    res: dict = {}
    for k, e in fields.items() if width else ():
        pre = k[:-len("expand")]
        if not (k.endswith("expand") and is_int(e) and e > 0):
            continue
        heads = [h for h in fields if h.startswith(pre) and role(h) == "heads"]
        dims = [h for h in fields if h.startswith(pre) and role(h) == "head_dim"]
        n = out.get(heads[0], fields[heads[0]]) if len(heads) == 1 and len(dims) == 1 else None
        states = [new_value(fields, out, h) for h in fields if h.startswith(pre) and "ssm" in h.split("_")
                  and role(h) == "width" and is_int(new_value(fields, out, h))]
        inner = states[0] if len(states) == 1 else e * width
        if is_int(n) and n > 0 and inner % n == 0:
            res[dims[0]] = inner // n
    return res


def windows(fields, out) -> dict:
    """A ``window_size`` at most the last stage's patch grid (Swin's image / patch / 2^(stages - 1))."""
    w, image, patch, depths = (new_value(fields, out, k) for k in ("window_size", "image_size", "patch_size", "depths"))
    if not (is_int(w) and is_int(image) and is_int(patch) and patch > 0
            and isinstance(depths, (list, tuple)) and depths):
        return {}
    last = max(1, image // patch // 2 ** (len(depths) - 1))
    return {"window_size": last} if w > last else {}


def layout_parts(fields, main, width) -> dict:
    """A layout embedding's 4 coordinate and 2 shape parts filling the width (LayoutLMv3's): filling the shrunk one."""
    c, s = fields.get("coordinate_size"), fields.get("shape_size")
    if not (is_int(c) and is_int(s) and is_int(main) and is_int(width) and 4 * c + 2 * s == main
            and width != main and width % 2 == 0 and width >= 6):
        return {}
    c = width // 6
    return {"coordinate_size": c, "shape_size": (width - 4 * c) // 2}


def multipliers(fields, main, width) -> dict:
    """EfficientNet's ``width_coefficient`` scaled as the main width, ``depth_coefficient`` at most 1."""
    res: dict = {}
    w, d = fields.get("width_coefficient"), fields.get("depth_coefficient")
    if isinstance(w, float) and is_int(main) and is_int(width) and width < main:
        res["width_coefficient"] = w * width / main
    if isinstance(d, float) and d > 1.0 and res:
        res["depth_coefficient"] = 1.0
    return res


STAGE_WIDTH = 256  # the last stage's shrunk width where a level's width is one per stage


def stage_widths(fields, main) -> dict:
    """A level with no main width and one ``embed_dim`` per stage (Florence 2's DaViT): each divided
    by one factor, the last to :data:`STAGE_WIDTH`."""
    v = fields.get("embed_dim")
    if main is not None or not (int_list(v) and len(v) > 1):
        return {}
    f = v[-1] // STAGE_WIDTH
    if f < 2 or any(x % f for x in v):
        return {}
    return {"embed_dim": type(v)(x // f for x in v)}


def multiplied_channels(fields, main, width) -> dict:
    """Beside a ``channel_multiplier`` list (a convolutional encoder's stages), each ``..._channels``
    wider than ``width`` scaled as the main width to a multiple of 8, at least ``width`` (the code
    normalises them in groups of a literal count: Emu3's ``GroupNorm(num_groups=32)``)."""
    multiplied = any("channel" in k and "multiplier" in k and isinstance(v, (list, tuple)) for k, v in fields.items())
    if not (multiplied and is_int(main) and is_int(width) and 0 < width < main):
        return {}
    return {k: max(width, int(round(v * width / main / 8)) * 8) for k, v in fields.items()
            if k.endswith("_channels") and is_int(v) and width < v}


def divided_widths(cfg, fields, out, source: str | None = None) -> dict:
    """A shrunk width the model code divides by a literal (LiLT's ``config.hidden_size // 6``) that
    the default divides and the shrunk one does not: their least common multiple. ``source``: the
    model code (default: :func:`model_source`)."""
    code = model_source(cfg) if source is None else source
    res: dict = {}
    for key, d in re.findall(r"config\.(\w+)\s*//\s*(\d+)\b", code):
        d = int(d)
        old, new = fields.get(key), res.get(key, out.get(key))
        if d > 1 and key in out and is_int(old) and is_int(new) and new > 0 and old % d == 0 and new % d != 0:
            res[key] = math.lcm(new, d)
    return res


def patch_pixels(fields, out) -> dict:
    """A patch embedding's input width (``C·P·P`` pixels: Pix2Struct's ``patch_embed_hidden_size``)
    that the shrink changed as equal to the model's width: kept."""
    ch = fields.get("num_channels") if is_int(fields.get("num_channels")) else 3
    res = {}
    for k, v in fields.items():
        t = set(k.split("_"))
        if "patch" in t and {"hidden", "embed"} & t and k.split("_")[-1] in ("size", "dim") and is_int(v) \
                and k in out and out[k] != v and ch > 0 and v % ch == 0 and math.isqrt(v // ch) ** 2 == v // ch:
            res[k] = v
    return res


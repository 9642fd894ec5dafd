"""The one generic rule that makes a tiny config of any family (no per-family sizes: :func:`shrink`),
and the model built on it."""
from __future__ import annotations

from .consistent import (feature_layers, group_heads, head_dim_sums, int_list, is_int, kept_layers, layer_spans,
                         mrope_sections, partition, per_count, repeats, split_to, state_head_dims, width_of, windows)
from .derived import (derived_sizes, feature_widths, grid_pinpoints, handed_channels, layer_ids, object_queries,
                      patch_queries, placeholder_tokens, query_image_tokens, rotary_widths, sliding_window,
                      stream_widths, tokens_per_image, tower_widths)

HIDDEN = 64          # the main width of every (sub-)config
HEADS = 4            # attention heads (largest power of two <= min(default, HEADS))
KV_HEADS = 2         # grouped key/value heads (MHA and MQA keep their kind)
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2           # main layer counts; qualified layer counts (dense, shared, ...) -> 1
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
VOCAB = 256
IMAGE = 64
WINDOW = 16          # local attention windows (Longformer's sequences are padded to one)
FILTERS = 8          # a convolutional codec's first channel count (doubled at each downsampling)

#: the rule, as a run's results state it
RULE = ("widths x 64/main width (multiple of 8; a list of one width per layer cut and scaled); heads -> power of "
        "two <= 4, kv heads keep MHA/MQA else 2, head dims 16; main layer counts -> 2, other layer counts and "
        "stage depths -> 1; experts -> 4, shared -> 1, per token -> 2 (also when left None beside an MoE width), "
        "routing/state groups -> 1, a group count equal to a width (one per channel) and a codebook_dim equal to "
        "a width shrunk with it, a ..._hidden_size equal to another tower's width -> 64; vocab (also per-layer "
        "input vocabularies; a vocab_size left None) -> 256 (token ids renumbered); image size -> 64; attention "
        "windows -> 16; a codec's num_filters -> 8; per-layer attributes of heterogeneous configs by their global "
        "value; recursively in sub-configs (benchmarks.coverage.shrink). Derived for the configs' validators "
        "(benchmarks.coverage.consistent): the kept layers hold every kind of each per-layer list (the first "
        "layers where the class refuses that), every per-layer list follows them; mrope sections sum to half the "
        "shrunk rotary width; a Swin window fits the last stage; qualified counts partitioning the layers set "
        "their number; a repeated layer pattern spells them; parts of the width and sizes equal to it follow it; "
        "state and summed head widths derived")

#: the most an int field of each role keeps
_CAP = {"vocab": VOCAB, "image": IMAGE, "window": WINDOW, "filters": FILTERS, "layers_other": 1, "groups": 1,
        "experts": EXPERTS, "experts_shared": 1, "experts_per_token": EXPERTS_PER_TOKEN}
_MAIN_WIDTH = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "emb_dim", "embedding_size",
               "hidden_dim")
_WIDTH_TOKENS = {"hidden", "intermediate", "embd", "embed", "emb", "embedding", "ffn", "ff", "dff",
                 "inner", "dim", "model", "width", "rank", "lowrank", "mlp", "d", "state", "ssm"}
_NOT_WIDTH = {"position", "positions", "patch", "image", "kernel", "window", "chunk", "stride",
              "bucket", "buckets", "distance", "max", "seq", "len", "length", "ctx", "sampling",
              "rate", "bins", "pool", "token", "tokens", "cache", "frames", "mel", "codebook",
              "top", "topk", "k", "vocab", "feature", "ratio", "multiplier", "factor", "multiple",
              "of", "by", "divisible", "groups", "group", "num", "layers", "layer", "heads",
              "head", "experts", "expert", "labels", "channels", "channel", "conv", "offset",
              "index", "idx", "size_per_layer_input", "per", "merge", "samples", "shape", "xpath",
              "tag", "subs", "unit", "rel", "padding", "round", "up", "to", "floor", "scale",
              "pretraining", "tp", "loop", "passes", "cycles", "hash", "seed"}
_MAIN_LAYER_TOKENS = {"num", "n", "hidden", "encoder", "decoder", "conf", "layers", "layer"}


def _tokens(name: str) -> list:
    return name.lower().split("_")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _scaled(v: int, scale: float) -> int:
    """A width scaled, rounded to a multiple of 8 (at least 8)."""
    return max(8, int(round(v * scale / 8)) * 8)


def role(name: str) -> str | None:
    """The role of an int config field, from its name alone: ``vocab``, ``token_id``, ``layers``
    (``layers_main`` / ``layers_other``), ``layer_index``, ``heads`` / ``kv_heads``,
    ``head_dim``, ``experts`` / ``experts_shared`` / ``experts_per_token``, ``groups``,
    ``image``, ``window``, ``filters``, ``width``; None for every other field (left at its default)."""
    t = _tokens(name)
    s = set(t)
    if name.startswith("_"):
        return None
    if "token" in s and t[-1] in ("id", "ids", "index") or name in ("unk_index", "mask_index"):
        return "token_id"
    if "vocab" in s and (t[-1] in ("size", "sizes", "vocab") or t[:2] == ["vocab", "size"]):
        return "vocab"  # (vocab_size_per_layer_input: Gemma 3n's and 4's per-layer embeddings)
    if "image" in s and t[-1] == "size":
        return "image"
    if t[-2:] == ["attention", "window"] or t[-3:] == ["attention", "window", "size"]:
        return "window"
    if name == "num_filters":
        return "filters"
    if ("head" in s or "heads" in s) and (s & {"dim", "size", "d", "channels"}) and "prediction" not in s:
        return "head_dim"
    if name in ("d_kv", "kv_channels", "dim_head", "d_head", "mamba_headdim"):
        return "head_dim"
    if "heads" in s or name == "n_head":
        if "per" in s and "ngram" in s:
            return None
        if s & {"kv", "key"} or ("query" in s and "groups" in s):
            return "kv_heads"
        return "heads"
    if name == "num_query_groups":
        return "kv_heads"
    if s & {"experts", "expert"} or name == "moe_k":
        if s & {"size", "dim", "hidden", "layer", "offset", "period"}:
            return "width" if s & {"size", "dim", "hidden"} else None
        if s & {"tok", "token", "top", "topk", "k"}:
            return "experts_per_token"
        if "shared" in s:
            return "experts_shared"
        return "experts"
    if name in ("moe_topk", "moe_top_k"):
        return "experts_per_token"
    if ("group" in s or "groups" in s) and (s & {"n", "num", "topk"}) and not s & {"hidden", "size"}:
        return "groups"
    if t[-1] in ("layers", "layer", "depth", "depths") and not s & {"offset", "period", "start", "end",
                                                                     "interval", "step", "per", "every"}:
        return "layers_main" if s <= _MAIN_LAYER_TOKENS | {"depth", "depths"} else "layers_other"
    if t[-1] in ("idx", "idxs", "ids", "indices", "indexes"):
        return "layer_index"
    if s & _WIDTH_TOKENS and not s & _NOT_WIDTH:
        return "width"
    return None


def _level_fields(cfg) -> dict:
    """The declared fields of a config (dataclass fields in transformers 5, else its ``__init__``
    parameters) with their values; derived attributes are not fields."""
    import dataclasses
    import inspect
    if dataclasses.is_dataclass(cfg):
        names = [f.name for f in dataclasses.fields(cfg)]
    else:
        names = [p for p in inspect.signature(type(cfg).__init__).parameters if p not in ("self", "kwargs")]
    out = {}
    for n in names:
        if n.startswith("_") and isinstance(getattr(type(cfg), n[1:], None), property):
            n = n[1:]  # a backbone's _out_indices: passed by its public name (out_indices)
        try:
            out[n] = getattr(cfg, n)
        except Exception:  # noqa: BLE001 - a per-layer attribute refuses a global read (Dots3's
            if n in vars(cfg):  # heads): the instance's own value
                out[n] = vars(cfg)[n]
    if isinstance(getattr(type(cfg), "out_indices", None), property) and "out_indices" not in out:
        out["out_indices"] = cfg.out_indices  # a backbone's stages read (ResNet: not a field)
    return out


def shrink(cfg, kinds: bool = False) -> dict:
    """The keyword overrides that make ``cfg`` (a config of its class's defaults) tiny: :data:`RULE`,
    by field name (:func:`role`), on every config and, recursively, every sub-config. Only declared
    fields are passed, so the config recomputes derived ones (``layer_types``); ``kinds`` True
    keeps a layer of each kind of every per-layer list, False the first layers."""
    return _shrink_level(cfg, _vocab_ids(cfg), _main_widths(cfg), kinds)


def _subs(fields) -> list:
    from transformers import PretrainedConfig
    return [v for v in fields.values() if isinstance(v, PretrainedConfig)]


def _main_widths(cfg) -> set:
    """The main widths (> HIDDEN) of ``cfg`` and of every sub-config: each becomes HIDDEN."""
    fields = _level_fields(cfg)
    main = width_of(fields, _MAIN_WIDTH)
    return ({main} if main and main > HIDDEN else set()).union(*(_main_widths(v) for v in _subs(fields)))


def _vocab_ids(cfg) -> dict:
    """``{old token id: new token id}`` for every token id >= VOCAB anywhere in ``cfg``."""
    from transformers import PretrainedConfig
    ids = set()

    def walk(c):
        for k, v in _level_fields(c).items():
            if isinstance(v, PretrainedConfig):
                walk(v)
            elif role(k) == "token_id":
                ids.update(x for x in (v if int_list(v) else [v] if is_int(v) else []) if x >= VOCAB)
    walk(cfg)
    return {old: VOCAB - 1 - i for i, old in enumerate(sorted(ids, reverse=True))}


def _shrink_level(cfg, id_map, mains=frozenset(), kinds=False) -> dict:
    from transformers import PretrainedConfig
    fields = _level_fields(cfg)
    out = {}
    main = width_of(fields, _MAIN_WIDTH)
    scale = HIDDEN / main if main and main > HIDDEN else 1.0
    q_heads = [v for k, v in fields.items() if role(k) == "heads" and is_int(v)]
    q_old = max(q_heads) if q_heads else None
    q_new = _pow2_floor(min(q_old, HEADS)) if q_old else HEADS
    old_layers = next((v for k, v in fields.items() if role(k) == "layers_main" and is_int(v)), None)
    new_layers = min(old_layers, LAYERS) if old_layers else None
    outputs = max((len(v) for k, v in fields.items() if role(k) == "layer_index" and "out" in _tokens(k)
                   and int_list(v) and old_layers and len(v) > 1 and max(v) <= old_layers), default=0)
    if outputs and new_layers:  # one layer more than the outputs a head reads (DPT's 4 features)
        new_layers = min(old_layers, max(new_layers, outputs + 1))
    new_layers = partition(fields, old_layers, new_layers, role)
    keep = kept_layers(fields, old_layers, new_layers, role, kinds)
    new_layers = len(keep) if keep else new_layers
    widths = {v: _scaled(v, scale) for k, v in fields.items()
              if role(k) == "width" and is_int(v) and v > 8 and scale != 1.0}
    counts = {k: (v, min(v, 1)) for k, v in fields.items() if role(k) == "layers_other" and is_int(v) and v > 1}
    # an MoE width beside expert counts left None (Dots1: torch.empty(None, ...)): the counts get shrunk values
    moe = any(role(k) == "width" and "moe" in _tokens(k) and is_int(v) and v > 0 for k, v in fields.items())
    for k, v in fields.items():
        if isinstance(v, PretrainedConfig):
            full = {a: b for a, b in _level_fields(v).items() if not isinstance(b, PretrainedConfig)}
            out[k] = {**full, **_shrink_level(v, id_map, mains, kinds), "model_type": getattr(v, "model_type", None)}
            if out[k]["model_type"] is None:
                del out[k]["model_type"]
            continue
        r, orig = role(k), v
        layer_list = r in ("layers_main", "layers_other")
        per_layer = keep is not None and isinstance(v, (list, tuple)) and len(v) == old_layers and not layer_list
        if per_layer:  # one entry per layer: the kept layers' entries
            v = type(v)(v[i] for i in keep)
        new = v
        if v is None and moe and r in ("experts", "experts_shared", "experts_per_token"):
            new = _CAP[r]
        elif v is None and k == "vocab_size":  # left for a checkpoint to state (a CTC head's letters)
            new = VOCAB
        elif v is None and r == "head_dim" and k == "head_dim" and q_old and main:
            new = int(main * scale) // q_new  # left None beside a head count (Ministral): the width per head
        elif v is None and r == "kv_heads" and q_old and k.startswith("num_"):
            new = q_new  # left None (Nemotron's default): multi-head
        elif isinstance(v, (list, tuple)) and not layer_list and per_count(k, v, counts):
            new = type(v)(v[:per_count(k, v, counts)])  # one entry per layer of a qualified count
        elif int_list(v) and len(v) > 1 and len(set(v)) == 1 and v[0] in widths:
            new = type(v)([widths[v[0]]] * len(v))  # one shrunk width per level (RT-DETR's decoder)
        elif r == "width" and int_list(v) and len(v) > 1 and sum(v) == main and scale != 1.0:
            new = type(v)(split_to(v, int(main * scale)))  # parts of the width (Reformer's axial positions)
        elif isinstance(v, (list, tuple)) and repeats(v, old_layers, new_layers):
            new = repeats(v, old_layers, new_layers)  # a pattern of layer kinds repeated (GPT-Neo)
        elif r == "layer_index" and "out" in _tokens(k) and int_list(v) and new_layers:
            new = type(v)(range(new_layers - len(v), new_layers))  # the layers a head reads: the last ones
        elif r == "width" and int_list(v) and per_layer:
            new = type(v)(_scaled(x, scale) if x > 8 else x for x in v)  # one width per layer (Gemma 3n)
        elif int_list(v) and r == "heads":
            new = type(v)(_pow2_floor(min(x, HEADS)) for x in v)
        elif int_list(v) and layer_list:
            if old_layers and len(v) == old_layers:  # one entry per layer: a layer list
                new = type(v)(v[:new_layers])
            elif r == "layers_other" and new_layers and all(x < old_layers for x in v if x >= 0):
                new = type(v)(x for x in v if x < new_layers) or type(v)([new_layers - 1])
            else:
                new = type(v)(min(x, 1) for x in v)
        elif int_list(v) and r == "token_id":
            new = type(v)(id_map.get(x, x) for x in v)
        elif int_list(v) and r == "layer_index":
            if new_layers:
                new = type(v)(x for x in v if x < new_layers) or type(v)([new_layers - 1])
        elif is_int(v):
            toks = _tokens(k)
            if r in _CAP:
                new = min(v, _CAP[r])
            elif r == "token_id":
                new = id_map.get(v, v)
            elif r == "heads":
                new = _pow2_floor(min(v, HEADS)) if v > 0 else v
            elif r == "kv_heads":
                new = q_new if (q_old is None or v == q_old) else (1 if v == 1 else min(KV_HEADS, q_new))
            elif r == "head_dim":
                new = HEAD_DIM if v > 0 else v
            elif r == "layers_main":
                new = new_layers if new_layers and v == old_layers else min(v, LAYERS)
            elif r == "width" and v in mains and ({"hidden", "size"} <= set(toks) or "out" in toks):
                new = HIDDEN  # another tower's width named here (BLT's hidden_size_global)
            elif r == "width" and v > 8:
                new = _scaled(v, scale)
            elif r is None and v == main and scale != 1.0 and toks[-1] in ("size", "dim"):
                new = int(main * scale)  # a size equal to the width is the width (an adapter's input)
            elif r is None and ("groups" in toks or toks[-2:] == ["codebook", "dim"]) and v in widths:
                new = widths[v]  # one group per channel, a codebook as wide as a width (Mimi's): alike
        if new != orig:
            out[k] = new
    if "out_indices" in out and "out_features" in fields:
        out["out_features"] = None  # derived from the indices by the backbone's config
    out.update(tokens_per_image(fields, out))
    out.update(query_image_tokens(fields, out, VOCAB - 1 - len(id_map)))
    out.update(sliding_window(fields, WINDOW))
    out.update(feature_layers(fields, out))
    out.update(layer_spans(fields, old_layers, new_layers))
    out.update(grid_pinpoints(fields, out))
    width = int(main * scale) if main else None
    out.update(state_head_dims(fields, out, width, role))
    out.update(derived_sizes(fields, out, main, width, cfg, VOCAB - 2 - len(id_map)))
    out.update(mrope_sections(cfg, fields, out, width, q_new))
    out.update(windows(fields, out))
    out.update(head_dim_sums(fields, out, role))
    out.update(group_heads(fields, out, role))
    out.update({**tower_widths(fields, out, _MAIN_WIDTH), **layer_ids(fields, out, role)})
    out.update(stream_widths(fields, out, _MAIN_WIDTH))
    out.update(rotary_widths(fields, out, _MAIN_WIDTH, q_new if q_old else None, HEAD_DIM))
    out.update(placeholder_tokens(fields, out, VOCAB))
    out.update(handed_channels(fields, out, _MAIN_WIDTH))
    out.update(patch_queries(fields, out))
    return {**out, **feature_widths(fields, out), **object_queries(fields, out)}


def tiny_config(model_type: str, kinds: bool | None = None):
    """``(config, overrides)``: the class's default config shrunk by :func:`shrink`; ``kinds``
    None: the first layers where that config validates, else a layer of each kind
    (:func:`.consistent.kept_layers`)."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    default, extra = default_config(cls)
    for keep in ((False, True) if kinds is None else (kinds,)):
        overrides = {**shrink(default, keep), **extra}
        try:
            return cls(**overrides), overrides
        except Exception:  # noqa: BLE001 - the validators' verdict: the other cut, else raised
            if keep or kinds is not None or overrides == {**shrink(default, True), **extra}:
                raise


def default_config(cls):
    """``(config, extra overrides)``: the class's defaults; a default timm backbone (DETR's), when
    timm is not installed, replaced by the config's own (``use_timm_backbone=False``), untrained."""
    import importlib.util
    cfg = cls()
    backbone = getattr(cfg, "backbone_config", None)
    if getattr(backbone, "model_type", None) == "timm_backbone" and importlib.util.find_spec("timm") is None:
        extra = {"use_timm_backbone": False, "use_pretrained_backbone": False}
        return cls(**extra), extra
    return cfg, {}


def own_config(cls, cfg):
    """The config ``cls`` is built on: ``cfg``, or the sub-config of the class's own kind (a
    composite's text config: Qwen3.5's LM; its one decoder)."""
    own = getattr(cls, "config_class", None)
    if not isinstance(own, type) or isinstance(cfg, own):
        return cfg
    try:
        text = cfg.get_text_config()
    except ValueError:  # more than one text config (MusicGen's text encoder and decoder)
        text = None
    if isinstance(text, own):
        return text
    subs = [v for v in vars(cfg).values() if isinstance(v, own)]
    return subs[0] if len(subs) == 1 else cfg


def redraw_parameters(model, gen) -> None:
    """Every 1-d parameter re-drawn (``*weight`` 1 + 0.5·N, else 0.5·N: norms at 1 and biases at 0
    hide a wrong slot, as in tests/conftest) and every constant matrix (0.02·N), from ``gen``."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta or not p.is_floating_point():
                continue
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0)
                        + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif p.numel() > 1 and float(p.std()) == 0.0:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def build(model_type: str, class_name: str, seed: int = 0):
    """``(model, overrides)``: ``class_name`` on the tiny config, float32, eval, random weights
    (:func:`redraw_parameters`). A sequence classifier or masked LM without a pad token gets the
    last id of its vocabulary (a classifier finds each row's last token by it, a masked LM counts
    positions from it, as real checkpoints state one)."""
    import torch
    import transformers
    cls = getattr(transformers, class_name)
    cfg, overrides = tiny_config(model_type)
    cfg = own_config(cls, cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # a composite's decoder reads it
    if class_name.endswith(("ForSequenceClassification", "ForMaskedLM")) and getattr(text, "pad_token_id", 0) is None:
        vocab = getattr(text, "vocab_size", None)
        text.pad_token_id = (vocab if is_int(vocab) else VOCAB) - 1
        overrides = {**overrides, "pad_token_id": text.pad_token_id}
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    redraw_parameters(model, torch.Generator().manual_seed(seed))
    return model, overrides

"""The one generic rule that makes a tiny config of any family (no per-family sizes), and
the model built on it."""
from __future__ import annotations

from .consistent import (head_dim_sums, kept_layers, mrope_sections, partition, per_count, repeats, split_to,
                         query_image_tokens, state_head_dims, tokens_per_image,
                         windows, sliding_window, feature_layers, grid_pinpoints, layer_spans, derived_sizes)
from .towers import tower_rules
from .detection import backbone_rules
from .tower_sizes import is_int

# --- the one shrinking rule -------------------------------------------------------------------

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
#: expert counts left None beside an MoE width: their shrunk values
_UNSET_EXPERTS = {"experts": EXPERTS, "experts_shared": 1, "experts_per_token": EXPERTS_PER_TOKEN}


def _tokens(name: str) -> list:
    return name.lower().split("_")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _is_int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(x) for x in v)


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
    """The declared fields of a config (dataclass fields in transformers 5, else its
    ``__init__`` parameters), with their current values; derived attributes are not fields."""
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
        except Exception:  # noqa: BLE001 - per-layer attributes refuse a global read
            # (heterogeneous configs: Dots3's heads, ranks and head dims): the global value
            # is the instance's own, and the per-layer overrides are derived from other fields
            if n in vars(cfg):
                out[n] = vars(cfg)[n]
    if isinstance(getattr(type(cfg), "out_indices", None), property) and "out_indices" not in out:
        out["out_indices"] = cfg.out_indices  # a backbone's stages read (ResNet: not a field)
    return out


def shrink(cfg, kinds: bool = False) -> dict:
    """The keyword overrides that make ``cfg`` (a config of its class's defaults) tiny.

    One rule, by field name (:func:`role`), for every config and, recursively, every sub-config
    (``text_config``, ``vision_config``, ...):

    * widths (hidden / intermediate / embedding / ffn / model / rank / state sizes): scaled by
      ``HIDDEN / main width`` (the first of hidden_size, d_model, n_embd, dim, embed_dim, ...),
      rounded to a multiple of 8 (at least 8; widths <= 8 kept); a ``..._hidden_size`` equal to
      the main width of some (sub-)config names that tower's width: HIDDEN, as that one becomes;
      a group count equal to a width (one group per channel) is shrunk as that width. A list of widths with one per
      layer is cut to the new layer count and scaled alike; other lists of widths are left alone.
    * heads: the largest power of two <= min(default, 4); kv heads: = heads when the default is
      multi-head, 1 when multi-query, else 2; head dims: ``HIDDEN / HEADS`` = 16.
    * layers: main counts (num_hidden_layers, n_layer, encoder_layers, depth ...) -> min(., 2),
      qualified counts (num_dense_layers, num_kv_shared_layers, ...) and per-stage depth lists
      -> min(., 1); lists as long as the old layer count are cut to the new one; lists of layer
      indices keep the indices below it (the last layer if none).
    * experts -> min(., 4), shared experts -> min(., 1), experts per token -> min(., 2); the
      same 4, 1, 2 for counts left None on a level with a positive MoE width (a width field
      named with ``moe``: ``moe_intermediate_size``); routing and state groups -> 1;
      vocabularies -> min(., 256) (a ``vocab_size`` left None -> 256), token ids beyond it
      renumbered from the top; image sizes
      -> min(., 64); attention windows (``attention_window``, ``..._attention_window_size``)
      -> min(., 16); a codec's first filter count (``num_filters``, doubled at each of its
      downsampling stages: VibeVoice's tokenizers reach 2048 channels from 32) -> min(., 8).

    Only declared fields are passed, so derived ones (``qk_head_dim``, ``layer_types`` computed
    from the layer count) are recomputed by the config itself. Sizes the config's validators
    relate to others are derived by :mod:`.consistent` (which layers are kept, mrope sections,
    windows, state and summed head widths, ...); ``kinds`` True keeps a layer of each kind of
    every per-layer list, False the first layers.
    """
    return _shrink_level(cfg, _vocab_ids(cfg), _main_widths(cfg), kinds)


def _main_widths(cfg) -> set:
    """The main widths (> HIDDEN) of ``cfg`` and of every sub-config: each becomes HIDDEN."""
    from transformers import PretrainedConfig
    fields = _level_fields(cfg)
    main = next((fields[k] for k in _MAIN_WIDTH if is_int(fields.get(k)) and fields[k] > 0), None)
    out = {main} if main and main > HIDDEN else set()
    for v in fields.values():
        if isinstance(v, PretrainedConfig):
            out |= _main_widths(v)
    return out


def _vocab_ids(cfg) -> dict:
    """``{old token id: new token id}`` for every token id >= VOCAB anywhere in ``cfg``."""
    from transformers import PretrainedConfig
    ids = set()

    def walk(c):
        for k, v in _level_fields(c).items():
            if isinstance(v, PretrainedConfig):
                walk(v)
            elif role(k) == "token_id":
                for x in (v if _is_int_list(v) else [v] if is_int(v) else []):
                    if x >= VOCAB:
                        ids.add(x)
    walk(cfg)
    return {old: VOCAB - 1 - i for i, old in enumerate(sorted(ids, reverse=True))}


def _shrink_level(cfg, id_map, mains=frozenset(), kinds=False) -> dict:
    from transformers import PretrainedConfig
    fields = _level_fields(cfg)
    out = {}
    main = next((fields[k] for k in _MAIN_WIDTH if is_int(fields.get(k)) and fields[k] > 0), None)
    scale = HIDDEN / main if main and main > HIDDEN else 1.0
    q_heads = [v for k, v in fields.items() if role(k) == "heads" and is_int(v)]
    q_old = max(q_heads) if q_heads else None
    q_new = _pow2_floor(min(q_old, HEADS)) if q_old else HEADS
    old_layers = next((v for k, v in fields.items() if role(k) == "layers_main" and is_int(v)), None)
    new_layers = min(old_layers, LAYERS) if old_layers else None
    outputs = _output_layers(fields, old_layers)
    if outputs and new_layers:  # one layer more than the outputs it selects (DPT's 4 features)
        new_layers = min(old_layers, max(new_layers, outputs + 1))
    new_layers = partition(fields, old_layers, new_layers, role)
    keep = kept_layers(fields, old_layers, new_layers, role, kinds)
    new_layers = len(keep) if keep else new_layers
    widths = {v: max(8, int(round(v * scale / 8)) * 8) for k, v in fields.items()
              if role(k) == "width" and is_int(v) and v > 8 and scale != 1.0}
    counts = {k: (v, min(v, 1)) for k, v in fields.items()
              if role(k) == "layers_other" and is_int(v) and v > 1}
    # an MoE width set while the expert counts are left None (Dots1: the config's defaults
    # would build torch.empty(None, ...)): the counts get their shrunk values
    moe = any(role(k) == "width" and "moe" in _tokens(k) and is_int(v) and v > 0
              for k, v in fields.items())
    for k, v in fields.items():
        if isinstance(v, PretrainedConfig):
            sub = _shrink_level(v, id_map, mains, kinds)
            full = _level_fields(v)
            full = {a: b for a, b in full.items() if not isinstance(b, PretrainedConfig)}
            out[k] = {**full, **sub, "model_type": getattr(v, "model_type", None)}
            if out[k]["model_type"] is None:
                del out[k]["model_type"]
            continue
        r = role(k)
        orig = v
        per_layer = keep is not None and isinstance(v, (list, tuple)) and len(v) == old_layers \
            and r not in ("layers_main", "layers_other")
        if per_layer:  # one entry per layer: the kept layers' entries
            v = type(v)(v[i] for i in keep)
        new = v
        if v is None and moe and r in _UNSET_EXPERTS:
            new = _UNSET_EXPERTS[r]
        elif v is None and k == "vocab_size":  # left for a checkpoint to state (a CTC head's
            new = VOCAB                        # letters: Wav2Vec2-BERT, ESM): the shrunk one
        elif v is None and r == "head_dim" and k == "head_dim" and q_old and main:
            new = int(main * scale) // q_new  # left None beside a head count, read as is by the
            #                                  model (Ministral, HunYuan): the width per head
        elif v is None and r == "kv_heads" and q_old and k.startswith("num_"):
            new = q_new  # left None (Nemotron's default): multi-head, as the configs that set it
        elif isinstance(v, (list, tuple)) and r not in ("layers_main", "layers_other") \
                and per_count(k, v, counts):  # one entry per layer of a qualified count
            new = type(v)(v[:per_count(k, v, counts)])
        elif _is_int_list(v) and len(v) > 1 and len(set(v)) == 1 and v[0] in widths:
            new = type(v)([widths[v[0]]] * len(v))  # one shrunk width per level (RT-DETR's decoder)
        elif r == "width" and _is_int_list(v) and len(v) > 1 and sum(v) == main and scale != 1.0:
            new = type(v)(split_to(v, int(main * scale)))  # parts of the width (Reformer's axial
            #                                                 position embeddings sum to it)
        elif isinstance(v, (list, tuple)) and repeats(v, old_layers, new_layers):
            new = repeats(v, old_layers, new_layers)  # a pattern of layer kinds repeated (GPT-Neo)
        elif r == "layer_index" and "out" in _tokens(k) and _is_int_list(v) and new_layers:
            # the layers whose outputs a head reads: as many as before, the last ones kept
            new = type(v)(range(new_layers - len(v), new_layers))
        elif r == "width" and _is_int_list(v) and per_layer:
            # one width per layer (Gemma 3n's intermediate sizes): cut and scaled as one
            new = type(v)(max(8, int(round(x * scale / 8)) * 8) if x > 8 else x for x in v)
        elif _is_int_list(v) and r in ("heads", "layers_main", "layers_other", "token_id", "layer_index"):
            if r == "heads":
                new = type(v)(_pow2_floor(min(x, HEADS)) for x in v)
            elif r in ("layers_main", "layers_other"):
                if old_layers and len(v) == old_layers:  # one entry per layer: a layer list
                    new = type(v)(v[:new_layers])
                elif r == "layers_other" and new_layers and all(x < old_layers for x in v if x >= 0):
                    new = type(v)(x for x in v if x < new_layers) or type(v)([new_layers - 1])
                else:
                    new = type(v)(min(x, 1) for x in v)
            elif r == "token_id":
                new = type(v)(id_map.get(x, x) for x in v)
            elif r == "layer_index" and new_layers:
                new = type(v)(x for x in v if x < new_layers) or type(v)([new_layers - 1])
        elif is_int(v):
            if r == "vocab":
                new = min(v, VOCAB)
            elif r == "token_id":
                new = id_map.get(v, v)
            elif r == "image":
                new = min(v, IMAGE)
            elif r == "window":
                new = min(v, WINDOW) if v > 0 else v
            elif r == "filters":
                new = min(v, FILTERS) if v > 0 else v
            elif r == "heads":
                new = _pow2_floor(min(v, HEADS)) if v > 0 else v
            elif r == "kv_heads":
                new = q_new if (q_old is None or v == q_old) else (1 if v == 1 else min(KV_HEADS, q_new))
            elif r == "head_dim":
                new = HEAD_DIM if v > 0 else v
            elif r == "layers_main":
                new = new_layers if new_layers and v == old_layers else min(v, LAYERS)
            elif r == "layers_other":
                new = min(v, 1)
            elif r == "experts":
                new = min(v, EXPERTS)
            elif r == "experts_shared":
                new = min(v, 1)
            elif r == "experts_per_token":
                new = min(v, EXPERTS_PER_TOKEN)
            elif r == "groups":
                new = min(v, 1) if v > 0 else v
            elif r == "width" and v in mains and ({"hidden", "size"} <= set(_tokens(k))
                                                  or "out" in _tokens(k)):
                new = HIDDEN  # another tower's width named here (a head's audio_hidden_size, BLT's
                #               hidden_size_global, Dots3's vision adapter_out_dim: the text width)
            elif r == "width" and v > 8:
                new = max(8, int(round(v * scale / 8)) * 8)
            elif r is None and v == main and scale != 1.0 and _tokens(k)[-1] in ("size", "dim"):
                new = int(main * scale)  # a size equal to the width is the width (an adapter's input)
            elif r is None and "groups" in _tokens(k) and v in widths:
                new = widths[v]  # one group per channel (a depthwise convolution's): shrunk alike
            elif r is None and _tokens(k)[-2:] == ["codebook", "dim"] and v in widths:
                new = widths[v]  # a codebook's vectors as wide as a width (Mimi's quantizer
                #                  compares them with its projection): shrunk alike
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
    out.update(tower_rules(fields, out, _MAIN_WIDTH, q_new if q_old else None, HEAD_DIM, VOCAB, role))
    return {**out, **backbone_rules(fields, out)}


def _output_layers(fields, old_layers) -> int:
    """The longest list of layers whose outputs a head reads (``out_indices``,
    ``backbone_out_indices``), 0 if none."""
    return max((len(v) for k, v in fields.items() if role(k) == "layer_index" and "out" in _tokens(k)
                and _is_int_list(v) and old_layers and len(v) > 1 and max(v) <= old_layers), default=0)


def tiny_config(model_type: str, kinds: bool | None = None):
    """``(config, overrides)``: the class's default config shrunk by :func:`shrink`; ``kinds``
    None: the first layers where that config validates, else the layers that keep each kind of
    its per-layer lists (:func:`.consistent.kept_layers`: OLMo-Hybrid's validator wants an
    attention layer among its linear ones)."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    default, extra = default_config(cls)
    for keep in ((False, True) if kinds is None else (kinds,)):
        overrides = {**shrink(default, keep), **extra}
        try:
            return cls(**overrides), overrides
        except Exception:  # noqa: BLE001 - the validators' verdict: the other cut, else raised
            if keep is True or kinds is not None or overrides == {**shrink(default, True), **extra}:
                raise
    raise AssertionError("unreachable")


def default_config(cls):
    """``(config, extra overrides)``: the class's defaults; a default backbone that needs timm
    (DETR's ResNet-50), when timm is not installed, replaced by the config's own transformers
    backbone (``use_timm_backbone=False``), never with pretrained weights."""
    import importlib.util
    cfg = cls()
    backbone = getattr(cfg, "backbone_config", None)
    if getattr(backbone, "model_type", None) == "timm_backbone" and importlib.util.find_spec("timm") is None:
        extra = {"use_timm_backbone": False, "use_pretrained_backbone": False}
        return cls(**extra), extra
    return cfg, {}


# --- building ---------------------------------------------------------------------------------


def own_config(cls, cfg):
    """The config ``cls`` is built on: ``cfg``, or a composite's text config when that is the
    class's own (Qwen3.5's LM)."""
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
    return subs[0] if len(subs) == 1 else cfg  # the one sub-config of the class's kind (its decoder)


def _construct(cls, class_name, model_type, seed):
    """``(model, overrides)``: ``cls`` on the tiny config (:func:`tiny_config`)."""
    import torch
    cfg, overrides = tiny_config(model_type)
    cfg = own_config(cls, cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # a composite's decoder reads it
    if class_name.endswith(("ForSequenceClassification", "ForMaskedLM")) and getattr(text, "pad_token_id", 0) is None:
        text.pad_token_id = (getattr(text, "vocab_size", None) if is_int(getattr(text, "vocab_size", None)) else VOCAB) - 1
        overrides = {**overrides, "pad_token_id": text.pad_token_id}
    torch.manual_seed(seed)
    return cls(cfg), overrides


def fails_at_default(model_type: str, class_name: str) -> str | None:
    """``"Type: message"`` of the exception with which transformers' own default config of the
    family fails to validate, or ``class_name`` fails to be constructed on it (on the meta
    device: no memory, no weights); None when both succeed."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING
    try:
        cls = getattr(transformers, class_name)
        cfg = own_config(cls, default_config(CONFIG_MAPPING[model_type])[0])
        with torch.device("meta"):
            cls(cfg)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' own is the answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None


def build(model_type: str, class_name: str, seed: int = 0):
    """``(model, overrides)``: ``class_name`` on the tiny config, float32, eval, random weights.
    A sequence classifier or masked LM without a pad token gets the last id of its vocabulary
    as one: a classifier finds each row's last token by the pad token (the example batch has two
    rows), a masked LM counts positions from it (ESM's, as RoBERTa's; real checkpoints state
    one)."""
    import torch
    import transformers
    cls = getattr(transformers, class_name)
    model, overrides = _construct(cls, class_name, model_type, seed)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta or p.numel() < 2 and p.dim() != 1:
                continue
            if p.dim() == 1:  # as tests/conftest: norms at 1 and biases at 0 hide a wrong slot
                p.copy_((1.0 if name.endswith("weight") else 0.0)
                        + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif float(p.std()) == 0.0:  # constant (often zero-initialised) matrices
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, overrides

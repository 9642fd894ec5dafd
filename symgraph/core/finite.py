"""The checks every reader of weights, configs and statistics shares: a model is a module
(:func:`require_module`), its values finite."""
from __future__ import annotations

import math

import torch

from ..errors import InputError

__all__ = ["all_finite", "check_keywords", "check_read", "check_config_numbers", "same_value", "require_finite",
           "require_module", "require_list", "require_bool", "zeros_and_ones", "class_defaults", "check_token_ids", "check_token_batch", "batch_list"]


def require_list(x, label: str, expected: str, single: tuple = ()) -> None:
    """Refuse ``x`` (named ``label``) unless it is a collection of items rather than one: a
    string, bytes or anything of the classes ``single`` (a module, a tensor, a dict) is one,
    though it iterates. One line naming what it is and what was ``expected``."""
    if isinstance(x, (str, bytes, *single)) or not hasattr(x, "__iter__"):
        raise InputError(f"{label} is a {type(x).__name__}; expected {expected}")


def require_bool(value, name: str) -> None:
    """Refuse a flag ``name`` that is not ``True`` or ``False`` (``0``, ``'yes'``)."""
    if not isinstance(value, bool):
        raise InputError(f"{name}={value!r}; expected True or False")


def require_module(m, label: str, expected: str = "a torch.nn.Module") -> None:
    """Refuse ``m`` (named ``label``: ``"model_a"``, ``"models[1]"``) unless it is a
    ``torch.nn.Module``, in one line naming what it is and what was ``expected``."""
    if not isinstance(m, torch.nn.Module):
        raise InputError(f"{label} is a {type(m).__name__}; expected {expected}")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: its smallest and largest values are (an inf is
    one of them; a NaN makes both NaN: PyTorch's min/max reductions propagate NaN). One pass in
    ``t``'s own dtype, no float32 copy (a float32 sum of a 16-bit tensor runs about 20× slower).
    Integer and empty tensors are finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_read(t: torch.Tensor, key: str, seen: set, whole: bool, where: str) -> None:
    """Refuse a read tensor ``key`` of ``where`` (e.g. ``"checkpoint 'dir'"``) with NaN or inf
    values; a whole tensor found finite is added to ``seen`` and not checked again."""
    if not t.is_floating_point() or (whole and key in seen):
        return
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise InputError(f"{where} has {bad} NaN/inf values in tensor {key!r}; expected finite weights "
                         "(was the model trained with a diverging loss?)")
    if whole:
        seen.add(key)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fields(d, prefix=""):
    """``(dotted name, value)`` of every number in a config's nested dicts and lists."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, (list, tuple)) else ()
    for k, v in items:
        name = f"{prefix}{k}" if isinstance(d, dict) else f"{prefix.rstrip('.')}[{k}]"
        if _is_number(v):
            yield name, v
        else:
            yield from _fields(v, name + ".")


#: How a config field that is a norm's (or an optimiser's) epsilon ends its name: it must not be negative.
EPS_SUFFIXES = ("eps", "epsilon")


def check_config_numbers(config: dict, where: str, default: dict | None = None) -> None:
    """Refuse, naming the field, a model config (``config.to_dict()``, nested dicts and lists
    included) holding a number that is NaN or infinite, or an epsilon (a field whose name ends
    in ``eps`` / ``epsilon``, e.g. ``rms_norm_eps``) below 0: such a model computes NaN (a
    norm's ``rsqrt(mean(x²) + eps)`` of a negative value), which every later stage would
    otherwise meet as NaN statistics. An infinity the model class's own ``default`` config
    holds in that field is its value, not a fault (Mamba-2's ``time_step_limit`` of
    ``(0.0, inf)``: no upper clamp)."""
    allowed = {n: v for n, v in _fields(default or {}) if isinstance(v, float) and math.isinf(v)}
    for name, v in _fields(config):
        if isinstance(v, float) and not math.isfinite(v) and allowed.get(name) != v:
            raise InputError(f"{where}: config field {name!r} is {v!r}; expected a finite number")
        if name.rsplit(".", 1)[-1].lower().endswith(EPS_SUFFIXES) and v < 0:
            raise InputError(f"{where}: config field {name!r} is {v!r}; expected a number >= 0 (an epsilon "
                             "added to keep a norm's denominator positive)")


def class_defaults(cfg) -> dict:
    """The default config of ``cfg``'s class as a dict (empty where it cannot be built), for
    :func:`check_config_numbers`."""
    try:
        return type(cfg)().to_dict()
    except Exception:  # noqa: BLE001 - a class without defaults: every infinity is refused
        return {}


def same_value(a, b) -> bool:
    """``a == b``, with NaN equal to NaN (in nested dicts and lists too): two configs that hold
    the same NaN field are the same config."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def require_finite(stage: str, what: str, *tensors: torch.Tensor):
    """``tensors`` (returned as they are: one, or a tuple), refused in one line naming ``stage``
    (``"REPAIR"``, ``"activation statistics"``) and ``what`` was measured when any holds a NaN
    or inf: statistics of a model that computes non-finite values on the data (an activation
    that overflows) would otherwise become zeros or a solver's traceback."""
    for t in tensors:
        if not all_finite(t.detach()):
            raise InputError(f"{stage}: {what} hold NaN/inf values; expected a model that computes finite "
                             "values there (are activations overflowing the dtype, or a config field off?)")
    return tensors[0] if len(tensors) == 1 else tensors


def check_token_ids(x: torch.Tensor, where: str, cfg) -> None:
    """Refuse token ids ``x`` (named ``where``: ``"'input_ids' in 'data.pt'"``) that are not
    integers or leave the vocabulary of the model's config ``cfg`` (any non-negative id without
    one), in one line naming their dtype or range, before a model's embedding fails on one
    ("index out of range")."""
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        what = "a bool mask" if x.dtype == torch.bool else "not token ids"
        raise InputError(f"{where} has dtype {str(x.dtype).removeprefix('torch.')} ({what}); expected an "
                         "integer tensor of token ids (int64 or int32)")
    if x.numel() == 0 or x.device.type == "meta":
        return
    vocab = getattr(cfg, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
    v = x.detach().cpu().numpy()  # numpy: torch has no min of uint16..64
    lo, hi = int(v.min()), int(v.max())
    if lo < 0 or hi >= (vocab if vocab is not None else 2 ** 63):
        raise InputError(f"{where} range over [{lo}, {hi}]; expected ids in "
                         + (f"[0, {vocab - 1}] (the model's vocabulary of {vocab} tokens)" if vocab is not None
                            else "[0, 2**63) (token ids are never negative)"))


def check_token_batch(batch, where: str, *models) -> None:
    """Refuse a keyword batch (named ``where``) whose ``input_ids`` are not token ids of every
    one of ``models`` (modules or checkpoints: their ``config``; :func:`check_token_ids`) or
    whose ``attention_mask`` has another shape than its ids (a mask of other rank, a model's
    own 4-d form, is the model's to read)."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor):
        return
    for m in models:
        check_token_ids(ids, f"'input_ids' of {where}", getattr(m, "config", None))
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == ids.dim() and mask.shape != ids.shape:  # 4-d: a model's own
        raise InputError(f"'attention_mask' of {where} has shape {tuple(mask.shape)} but its 'input_ids' "
                         f"{tuple(ids.shape)}; expected one mask entry per token")


def check_keywords(model, kwargs: dict, where: str) -> None:
    """Refuse a keyword input (of ``where``) that no ``forward`` of ``model`` can read by name: one
    that its forward neither names nor lists in the type of its ``**kwargs`` (transformers'
    ``Unpack[...]`` of a ``TypedDict``) and that no submodule's forward names either (a forward
    hands its ``**kwargs`` on: Wav2Vec2's CTC head to the model that reads ``mask_time_indices``).
    A forward whose ``**kwargs`` is untyped, or whose hints do not resolve, may read any keyword:
    nothing is refused there (an unknown keyword without ``**kwargs`` is Python's own error)."""
    import inspect
    import typing
    try:
        params = inspect.signature(model.forward).parameters
        var = next((p for p in params.values() if p.kind is p.VAR_KEYWORD), None)
        typed = typing.get_args(typing.get_type_hints(type(model).forward).get(var.name)) if var else ()
    except Exception:  # noqa: BLE001 - hints that do not resolve say nothing
        return
    dicts = [t for t in typed if typing.is_typeddict(t)]
    if len(dicts) != 1:  # untyped **kwargs (or none): nothing to hold a name against
        return
    known = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    known |= set(dicts[0].__annotations__)
    unknown = set(map(str, kwargs)) - known
    for cls in {type(m) for m in model.modules()} if unknown else ():  # names the forward hands on
        try:
            unknown -= set(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError, AttributeError):
            return
    if unknown:
        raise InputError(f"{where} hold {sorted(unknown)}, which no forward of {type(model).__name__} takes; "
                         f"expected inputs among {sorted(known)}")


def batch_list(data, *models) -> list | None:
    """The user's ``data`` (an iterable of batches, or None) as a list, refused before any model
    runs on it where empty, where its batches hold different inputs, or where a batch's tokens
    are not token ids of every one of ``models`` (:func:`check_token_batch`), naming the batch."""
    if data is None:
        return None
    require_list(data, "data", "a list of batches (each a dict of keyword inputs, or a tuple of tensors)",
                 (torch.Tensor, dict))
    data = list(data)
    if not data:
        raise InputError("data is empty; expected at least one batch")
    keys = [sorted(map(str, b)) if isinstance(b, dict) else None for b in data]
    for i, b in enumerate(data):
        if keys[i] != keys[0]:
            raise InputError(f"data[{i}] holds {keys[i] if keys[i] is not None else type(b).__name__} where data[0] "
                             f"holds {keys[0] if keys[0] is not None else type(data[0]).__name__}; expected "
                             "batches of the same inputs")
        _check_data_batch(b, f"data[{i}]")
        check_token_batch(b, f"data[{i}]", *models)
    for m in models:  # the batches hold the same inputs: the first one's names stand for all
        if isinstance(m, torch.nn.Module) and isinstance(data[0], dict):
            check_keywords(m, data[0], "data[0]")
    return data


def zeros_and_ones(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is 0 or 1 (an attention mask's)."""
    return not t.is_complex() and bool(((t == 0) | (t == 1)).all())


def _check_data_batch(batch, where: str) -> None:
    """Refuse a data batch (named ``where``) holding a tensor on ``meta`` (no values to run on) or
    token ids that are not a batch of sequences (``[N, S]``, or ``[N, C, S]`` for a multiple
    choice head) with at least one token, as a data file's would be."""
    items = batch.items() if isinstance(batch, dict) else enumerate(batch if isinstance(batch, (tuple, list)) else (batch,))
    for name, t in items:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise InputError(f"{where}'s {name!r} is on the meta device (no values); expected tensors with data")
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if isinstance(ids, torch.Tensor) and (ids.dim() < 2 or 0 in ids.shape):
        raise InputError(f"'input_ids' of {where} has shape {tuple(ids.shape)}; expected a batch of sequences [N, S] "
                         "with at least one token")
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() and not zeros_and_ones(mask):
        raise InputError(f"'attention_mask' of {where} holds values other than 0 and 1; expected 1 for a token, 0 "
                         "for padding")

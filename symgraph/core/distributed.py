"""Statistics over data sharded across processes (``torch.distributed``).

Activation similarity, Fisher and RegMean Gram matrices and REPAIR's per-channel moments are
sums over data batches (and counts of samples). Run under ``torchrun`` with a process group
initialised, each process measures its own shard of the batches (:func:`shard`) and the sums
and counts are all-reduced (SUM) at the end of each statistic, before any division: every
process then holds the statistics one process would compute on all the data (up to the
order of float64 additions), and the solves that follow (alignment, merge) are
deterministic, so every rank gets the same alignment and the same merged model.

Weight matching itself is shared too: each rank solves its share of a sweep's units and the
residual stream's similarity is split by slot, with one process's elements bit for bit
(:mod:`symgraph.alignment.shared`).

Without an initialised process group of more than one process (:func:`is_active` False)
every helper here is a no-op: single-process results are unchanged, bit for bit.

Communication follows the backend: gloo reduces CPU tensors, NCCL CUDA tensors (on
``torch.cuda.current_device()``, which each rank must have set); tensors elsewhere are moved
there and back, to their own device and dtype. Floating values are reduced in float64,
integer counts in int64.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError

__all__ = ["is_active", "rank", "world_size", "shard", "all_reduce_sum", "all_reduce_dict"]

_BUCKET = 1 << 24  # elements per flattened all_reduce (128 MiB of float64)


def is_active() -> bool:
    """Whether statistics are reduced: ``torch.distributed`` is available and initialised,
    with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    """The number of processes (1 when not distributed)."""
    return dist.get_world_size() if is_active() else 1


def shard(batches) -> list:
    """This rank's share of ``batches``: ``batches[rank::world_size]`` (all of them when not
    distributed). Every rank must pass the same batches in the same order; each shard must be
    non-empty (symgraph refuses empty data), so there must be at least one batch per rank.
    Uneven shards are fine: statistics are sums, and counts are reduced with them."""
    batches = list(batches)
    r, k = rank(), world_size()
    if len(batches) < k:
        raise InputError(f"{len(batches)} data batches for {k} processes; expected at least one "
                         "batch per process")
    return batches[r::k]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum is reduced in: float64, complex128 or int64."""
    if dtype.is_complex:
        return torch.complex128
    return torch.float64 if dtype.is_floating_point else torch.int64


def _device(like: torch.device | None = None) -> torch.device:
    """Where the backend reduces: CUDA (the current device) for NCCL, the CPU for gloo;
    other backends (or several, ``"cpu:gloo,cuda:nccl"``) reduce ``like``'s device."""
    backend = str(dist.get_backend())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" or like is None:
        return torch.device("cpu")
    return like


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes, in place; returns ``tensor``. The reduction runs in
    float64 (int64 for integers) on the backend's device, and the result is written back in
    ``tensor``'s own dtype and device. A no-op when not distributed."""
    if not is_active():
        return tensor
    dev, wide = _device(tensor.device), _wide(tensor.dtype)
    with torch.no_grad():
        direct = tensor.device == dev and tensor.dtype == wide and tensor.is_contiguous()
        buf = tensor if direct else tensor.detach().to(device=dev, dtype=wide).contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        if not direct:
            tensor.copy_(buf)
    return tensor


def _meta(key, value):
    """``(kind, shape, dtype)`` of one entry: a tensor, or a Python number."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if isinstance(value, (bool, int)):
        return "int", (), torch.int64
    if isinstance(value, float):
        return "float", (), torch.float64
    raise InputError(f"statistic {key!r} is a {type(value).__name__}; expected a tensor or a "
                     "Python number to reduce")


def _ordered(keys):
    try:
        return sorted(keys)
    except TypeError:  # keys of mixed types: any order every rank agrees on
        return sorted(keys, key=repr)


def all_reduce_dict(d: dict) -> dict:
    """``{key: Σ over processes}`` for a dict of tensors (and Python numbers: counts), whose
    key sets may differ between processes: the result has the union of the keys (sorted), a
    key missing here counting as zeros of the shape and dtype it has elsewhere. Each tensor
    comes back in its own dtype and device; a key missing here in the dtype it has elsewhere,
    on the device of this process's other tensors (the backend's when there are none). A key
    must have one shape and dtype on every process. Returns ``d`` itself when not
    distributed; else a new dict (``d`` is not modified)."""
    if not is_active():
        return d
    union = _union(d)
    keys = _ordered(union)
    here = next((v.device for v in d.values() if isinstance(v, torch.Tensor)), None)
    dev = _device(here)
    out: dict = {}
    with torch.no_grad():
        for wide, ks in _buckets(keys, union):
            _reduce_bucket(d, union, wide, ks, dev, here if here is not None else dev, out)
    return {k: out[k] for k in keys}


def _union(d: dict) -> dict:
    """``{key: (kind, shape, dtype)}`` over every process's keys, refused where two disagree."""
    local = {k: _meta(k, v) for k, v in d.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)  # keys, shapes and dtypes of every process
    union: dict = {}
    for r, metas in enumerate(everyone):
        for k, m in metas.items():
            if union.setdefault(k, m) != m:
                raise InputError(f"statistic {k!r} is {union[k][0]} {list(union[k][1])} "
                                 f"{union[k][2]} on one process and {m[0]} {list(m[1])} {m[2]} on "
                                 f"rank {r}; expected the same models on every process")
    return union


def _buckets(keys, union) -> list:
    """``[(reduced dtype, keys)]``: buckets of one reduced dtype, at most ``_BUCKET`` elements
    (or one larger tensor); the same on every process since they follow the union's metadata."""
    buckets: list[list] = []
    open_: dict[torch.dtype, list] = {}
    for k in keys:
        kind, shape, dtype = union[k]
        wide, n = _wide(dtype), max(1, _numel(shape))
        b = open_.get(wide)
        if b is None or (b[1] and b[1] + n > _BUCKET):
            b = open_[wide] = [wide, 0, []]
            buckets.append(b)
        b[1] += n
        b[2].append(k)
    return [(wide, ks) for wide, _, ks in buckets]


def _reduce_bucket(d, union, wide, ks, dev, fill, out):
    """Sum one bucket's keys over the processes into ``out``, each in its own dtype (a key
    missing here on ``fill``'s device)."""
    parts = []
    for k in ks:
        kind, shape, dtype = union[k]
        v = d.get(k)
        if v is None:
            parts.append(torch.zeros(_numel(shape), dtype=wide, device=dev))
        elif kind == "tensor":
            parts.append(v.detach().reshape(-1).to(device=dev, dtype=wide))
        else:
            parts.append(torch.tensor([v], dtype=wide, device=dev))
    buf = torch.cat(parts)  # a new tensor: ``d`` stays as it was
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    at = 0
    for k in ks:
        kind, shape, dtype = union[k]
        x = buf[at:at + _numel(shape)]
        at += _numel(shape)
        if kind == "tensor":
            v = d.get(k)
            # views of ``buf`` where nothing changes: the bucket holds only results
            out[k] = x.reshape(shape).to(device=v.device if v is not None else fill, dtype=dtype)
        else:
            out[k] = int(x.item()) if kind == "int" else float(x.item())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

"""Lazy views of checkpoints for the merge engine (:mod:`symgraph.merging.streaming`).

:class:`Folded`: a checkpoint's tensors with the report's norm gains folded, what weight
matching reads. :class:`Aligned`: a model's tensors carried into the anchor's basis (its maps
applied, its norm gains unfolded into the anchor's), what a method's statistics are measured on
and what is combined. Both read a tensor when it is asked for and keep the most recently used
ones up to a budget of bytes. :class:`Ledger` counts the bytes the engine holds.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace

import torch

from ...alignment.weights import WeightFeatures
from ...core.elements import elements_on
from ...transform import folding
from ...transform.apply import move

__all__ = ["Folded", "TensorCache", "Aligned", "Sides", "Ledger", "Sliced", "nbytes", "fit_dtype",
           "known_name", "DEFAULT_CACHE", "return_freed_memory"]

DEFAULT_CACHE = 64 << 20  # bytes of folded tensors kept per model while aligning (about a layer of 1.1B's MLP)


def nbytes(t) -> int:
    """The bytes of a tensor's elements (0 for anything else)."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class Ledger:
    """The bytes of tensors the engine holds: :meth:`hold` when it takes some, :meth:`drop`
    when it lets them go; ``peak`` is the most held at once. What the merge tests bound (the
    engine's own working set, not the allocator's or the interpreter's)."""

    def __init__(self):
        self.now = self.peak = 0

    def hold(self, n: int):
        self.now += int(n)
        self.peak = max(self.peak, self.now)

    def drop(self, n: int):
        self.now -= int(n)


class TensorCache:
    """Most recently used ``name -> tensor`` up to ``budget`` bytes (a larger tensor is not
    kept), its bytes counted in ``ledger``."""

    def __init__(self, budget: int, ledger: Ledger | None = None):
        self.budget, self.ledger = budget, ledger or Ledger()
        self._cache: OrderedDict = OrderedDict()
        self._bytes = 0

    def get(self, name):
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        return None

    def put(self, name, v):
        size = nbytes(v)
        if size > self.budget:
            return
        if name in self._cache:
            self._pop(name)
        self._cache[name] = v
        self._bytes += size
        self.ledger.hold(size)
        while self._bytes > self.budget:
            self._pop(next(iter(self._cache)))

    def _pop(self, name):
        size = nbytes(self._cache.pop(name))
        self._bytes -= size
        self.ledger.drop(size)

    def clear(self):
        self.ledger.drop(self._bytes)
        self._cache.clear()
        self._bytes = 0


class Folded(Mapping):
    """Parameter name → tensor of a :class:`~symgraph.checkpoints.sharded.Checkpoint` with the
    report's norm gains folded (what the symmetry classes act on), read on demand. A fold's
    tensors are read and folded together; the most recently used values are kept up to
    ``budget`` bytes. ``device``: where the values are put (the checkpoint is read on the CPU).

    On a device, the ``budget`` is kept in host memory (page-locked on CUDA, so a value goes to
    the device at the link's full rate) and at most :data:`DEFAULT_CACHE` bytes of the most
    recent values on the device: weight matching's sweeps read every tensor about twice a sweep,
    and a value kept on the host is copied to the device again instead of read from the
    checkpoint and folded again; the device's memory holds only the working set."""

    def __init__(self, report, ckpt, budget: int = DEFAULT_CACHE, dtype=torch.float64,
                 device=None, ledger: Ledger | None = None):
        self.report, self.ckpt, self.dtype, self.device = report, ckpt, dtype, device
        self.folds = {n: folding.for_reader(f, n) for f in report.folds for n in folding.members(f)}  # per tensor
        self._cache = TensorCache(budget, ledger)
        self._near = TensorCache(min(budget, DEFAULT_CACHE), ledger) if device is not None else None
        self._pin = device is not None and torch.device(device).type == "cuda"

    def _host(self, name):
        v = self._cache.get(name)
        if v is not None:
            return v
        f = self.folds.get(name)
        if f is None:
            v = self.ckpt.get(name)
        else:  # this tensor's part of its fold only: the gain (and shift), its reader, its bias
            raw = {n: self.ckpt.get(n) for n in folding.members(f)}
            v = folding.fold([f], raw, _fold_dtype(f, raw, self.dtype)).get(name, raw[name]).to(raw[name].dtype)
        if self._pin and nbytes(v) <= self._cache.budget:
            try:
                v = v.pin_memory()
            except RuntimeError:  # pragma: no cover - page-locked memory refused: pageable copies
                self._pin = False
        self._cache.put(name, v)
        return v

    def __getitem__(self, name):
        if self._near is None:
            return self._host(name)
        v = self._near.get(name)
        if v is None:
            v = self._host(name).to(self.device, non_blocking=self._pin)
            self._near.put(name, v)
        return v

    def clear(self):
        """Drop the cached values. The alignment's bookkeeping holds this mapping in reference
        cycles, which would keep the cache (up to ``budget``) until Python's cycle collector
        runs: on the 1.1B shape, through the write."""
        self._cache.clear()
        if self._near is not None:
            self._near.clear()

    def __iter__(self):
        return iter(self.report.parameters)

    def __len__(self):
        return len(self.report.parameters)


class Aligned:
    """Model ``ckpt``'s graph tensors in the anchor's basis, read on demand: each parameter's
    unit (a norm fold's gain, shift and readers together; any other tensor alone) read, moved by
    ``alignment`` (None: already in the anchor's basis) with its gains unfolded into the
    anchor's (``anchor``: the anchor's checkpoint), and cast back to the stored dtype: what
    ``Alignment.apply`` makes of a loaded model, one unit at a time. ``fetch(name)`` is what
    :class:`~symgraph.alignment.graphrun.Stepper` reads; buffers no class moves (computed
    rotary frequencies) are the checkpoint's own."""

    def __init__(self, ckpt, alignment, anchor, report, work=torch.float32, budget: int = DEFAULT_CACHE,
                 ledger: Ledger | None = None):
        self.ckpt, self.alignment, self.anchor, self.work = ckpt, alignment, anchor, work
        self.report = alignment.report_b if alignment is not None else report
        self.units = self.report.fold_groups if alignment is not None else {}
        self.known = set(self.report.parameters) | set(self.report.buffers) if self.report is not None else set()
        self._cache = TensorCache(budget, ledger)

    def fetch(self, name):
        n = known_name(self.ckpt, name, self.known, name)
        v = self._cache.get(n)
        if v is not None:
            return v
        if self.alignment is None or n not in self.known:
            return self.ckpt.fetch(name)
        unit = self.units.get(n, (n,))
        raw = {m: self.ckpt.get(m, check=False) for m in unit}
        gauge = {m: self.anchor.get(m, check=False) for m in unit if raw[m].dim() <= 1}
        moved = move(self.report, self.alignment.elements, raw, gauge, dtype=self.work)
        for m in unit:
            self._cache.put(m, moved[m].to(raw[m].dtype) if m in moved else raw[m])
        return moved[n].to(raw[n].dtype) if n in moved else raw[n]

    def clear(self):
        self._cache.clear()


class Sides:
    """What fitting the full groups (:mod:`symgraph.alignment.fullgroups`) reads of checkpoint
    ``ckpt`` and the ``anchor``'s, out of core: the anchor's stored tensors, and ``ckpt``'s
    carried into the anchor's basis by the elements of the moment (an :class:`Aligned` in
    :attr:`work`, cast to the stored dtype: what :meth:`~symgraph.Alignment.state` gives a
    loaded model), each read on demand and kept up to ``budget`` bytes, counted in ``ledger``,
    put on ``device``; ``folded``: the two checkpoints' :class:`Folded` views, which the
    continuous classes are re-solved from (their slices gathered in :attr:`work`).

    ``work`` (:func:`fit_dtype`): float64, as in memory, unless both checkpoints' weights are
    16-bit; then float32, half the bytes (17 MB of pooled similarities a layer at the 1.1B shape
    instead of 34) at little loss: a product of two 16-bit values is exact in float32, and the
    moved values are rounded to 16 bits either way."""

    def __init__(self, anchor, ckpt, folded, budget: int = DEFAULT_CACHE, ledger: Ledger | None = None,
                 device=None):
        self.A, self.ckpt, self.folded, self.device = anchor, ckpt, tuple(folded), device
        self.budget, self.ledger = budget, ledger or Ledger()
        self.work = fit_dtype(anchor, ckpt)
        self._a = TensorCache(budget, self.ledger)
        self._view: Aligned | None = None

    def anchor(self, name):
        v = self._a.get(name)
        if v is None:
            v = self.A.get(name)
            v = v if self.device is None else v.to(self.device)
            self._a.put(name, v)
        return v

    def moved(self, al):
        """B in A's basis by ``al``'s elements of the moment. Its values, and the anchor's, are
        kept only while the returned mapping lives (a fit's pass over the classes): the
        elements change after it, and the continuous classes' similarity that comes next reads
        the folded views, not these (0.13 GB at the 1.1B shape's peak)."""
        if self._view is not None:
            self._view.clear()
        now = replace(al, elements=elements_on(al.elements, "cpu"))  # later fits replace elements, not this
        self._view = Aligned(self.ckpt, now, self.A, None, self.work, self.budget, self.ledger)
        out = _OnDevice(self._view.fetch, self.device)
        weakref.finalize(out, _clear, self._view._cache, self._a)
        return out

    def features(self, ra, rb):
        return WeightFeatures(ra, rb, *self.folded, exact_dtype=self.work)

    def release(self):
        self._a.clear()
        if self._view is not None:
            self._view.clear()
        self._view = None


def known_name(ckpt, name, known, default=None):
    """``name`` if in ``known``, else the name in ``known`` that its tied parameter (stored
    once in ``ckpt``) also goes by, else ``default``."""
    if name in known:
        return name
    return next((n for n in ckpt.params.get(ckpt.param_of.get(ckpt.key(name)), ()) if n in known), default)


def fit_dtype(*ckpts) -> torch.dtype:
    """What :class:`Sides` computes in for checkpoints ``ckpts``: float32 when each one's
    weights are 16-bit (its most common floating-point dtype is bfloat16 or float16), else
    float64."""
    return torch.float32 if all(c.dtype in (torch.bfloat16, torch.float16) for c in ckpts) else torch.float64


def _clear(*caches):
    for c in caches:
        c.clear()


class _OnDevice:
    """``[name]``: ``fetch(name)`` on ``device`` (None: where it is)."""

    def __init__(self, fetch, device):
        self.fetch, self.device = fetch, device

    def __getitem__(self, name):
        v = self.fetch(name)
        return v if self.device is None else v.to(self.device)


def _fold_dtype(f, raw, dtype):
    """What a fold computes in: the tensors' own 16-bit dtype when it has no shift and every
    tensor is in that dtype (a gain times a weight is exact in float32 for 16-bit inputs and the
    result is rounded once either way: the same bits, without float32 copies), else ``dtype``."""
    dts = {t.dtype for t in raw.values()}
    if f.shift is None and len(dts) == 1 and next(iter(dts)) in (torch.bfloat16, torch.float16):
        return next(iter(dts))
    return dtype


def return_freed_memory():
    """Ask glibc to serve allocations from 1 MiB up with their own mappings, returned to the
    system when freed. Its default threshold grows to 32 MiB as blocks are freed, so the
    tensors of a layer come from the heap and its high-water mark stays resident (on a
    TinyLlama-1.1B-shaped pair: 1.7 GB resident after alignment for 34 MB of live tensors).
    Process-wide, like any mallopt; a no-op without glibc."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


class Sliced(Mapping):
    """A model's statistics with each tensor of a sliced name cut like the name's slice (a
    statistic of the tensor's own shape; others, such as a Gram over a weight's inputs, whole)."""

    def __init__(self, stats, parts, shapes, ledger, elementwise: bool = True):
        self.stats, self.parts, self.shapes, self.ledger, self.read = stats, parts, shapes, ledger, 0
        self.elementwise = elementwise  # the method's: statistics of the tensors' own shapes

    def __getitem__(self, name):
        part = self.parts.get(name) if self.elementwise else None
        if part is not None and hasattr(self.stats, "part"):  # the store reads the slice alone
            t = self.stats.part(name, part, self.shapes[name])  # (or the whole, of another shape)
            part = None
        else:
            t = self.stats[name]
        self.read += nbytes(t)  # held until the group is combined
        self.ledger.hold(nbytes(t))
        if part is None or tuple(t.shape) != tuple(self.shapes[name]):
            return t
        d, start, stop = part
        return t.narrow(d, start, stop - start)

    def __contains__(self, name):
        return name in self.stats

    def __iter__(self):
        return iter(self.stats)

    def __len__(self):
        return len(self.stats)

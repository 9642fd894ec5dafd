"""Statistics over data taken out of core, and the store they are spilled to.

:func:`input_grams` takes RegMean's :class:`~.statistics.InputGrams`: the anchor's graph run op
by op (:func:`~.segments.op_by_op`) on each model carried into the anchor's basis, in passes
whose Grams fit the budget (every batch's run paused where a pass ends and resumed by the next:
each op runs once per batch), a pass's Grams written to disk as it ends. :class:`Spill` is the
disk store, :class:`MemorySpill` the one in memory for a merge of loaded models.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...alignment.checks import by_shape
from ...core import distributed
from ...checkpoints.leftovers import RUN_MARKER, mark_run
from ...core.files import file_id, identity, remove_own
from ...core.progress import bar
from .segments import op_by_op
from .views import Aligned, nbytes

__all__ = ["Spill", "MemorySpill", "Stored", "input_grams"]


class Spill:
    """Tensors written to safetensors files in a temporary directory under ``parent`` (beside
    the output's temporary directory; removed by :meth:`close`), read back one at a time. The
    directory carries this run's marker, so that the next run beside it removes it should this
    one be killed (:mod:`symgraph.checkpoints.leftovers`)."""

    PREFIX = ".symgraph-tmp-stats-"

    def __init__(self, parent: str | None = None):
        self.dir = tempfile.mkdtemp(prefix=self.PREFIX, dir=parent)
        self._made = identity(self.dir)
        self._files: dict = {}  # the files written here -> their identity: all close() deletes
        self.where: dict = {}
        mark_run(self.dir, None)  # for no one --out: any later run beside it sweeps it once this one is dead
        self._files[RUN_MARKER] = file_id(os.lstat(os.path.join(self.dir, RUN_MARKER)))

    def put(self, tensors: dict):
        if not tensors:
            return
        name = f"part-{len(self._files):05d}.safetensors"
        path = os.path.join(self.dir, name)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path)
        self._files[name] = file_id(os.lstat(path))
        self.where.update((k, path) for k in tensors)

    def get(self, key: str, part=None, shape=None) -> torch.Tensor:
        """Tensor ``key``; with ``part = (dim, start, stop)``, only that slice of it when its
        shape is ``shape`` (read from disk alone; otherwise the whole tensor)."""
        with safe_open(self.where[key], framework="pt", device="cpu") as h:
            if part is not None:
                sl = h.get_slice(key)
                if tuple(sl.get_shape()) == tuple(shape):
                    d, start, stop = part
                    return sl[(slice(None),) * d + (slice(start, stop),)]
            return h.get_tensor(key)

    def __contains__(self, key):
        return key in self.where

    def close(self):
        """Delete the files written here and the directory, if they are still the ones made."""
        remove_own(self.dir, self._made, self.PREFIX, only=self._files)


class MemorySpill:
    """:class:`Spill`'s interface over tensors kept in memory: the store of a merge of models
    already loaded (:func:`symgraph.merge`), which writes no file. :meth:`get` returns a copy,
    as a read from disk does (a combine may work in its statistics' tensors in place)."""

    def __init__(self):
        self._tensors: dict = {}

    def put(self, tensors: dict):
        self._tensors.update((k, v.detach()) for k, v in tensors.items())

    def get(self, key: str, part=None, shape=None) -> torch.Tensor:
        t = self._tensors[key]
        if part is not None and tuple(t.shape) == tuple(shape):
            d, start, stop = part
            t = t.narrow(d, start, stop - start)
        return t.clone()

    def __contains__(self, key):
        return key in self._tensors

    def close(self):
        self._tensors.clear()


class Stored(Mapping):
    """One model's statistic as a mapping ``name -> tensor`` read from a :class:`Spill`:
    ``keys`` maps each name to its key in the store (names may share one, as the weights that
    read one input share its Gram)."""

    def __init__(self, spill: Spill, keys: dict, device=None):
        # not ``self.keys``: that would hide Mapping.keys() (and break ``dict(stored)``)
        self.spill, self._keys, self.device = spill, keys, device

    def __getitem__(self, name):
        return self.part(name)

    def part(self, name, part=None, shape=None):
        """``self[name]``, or with ``part = (dim, start, stop)`` only that slice of it when its
        shape is ``shape`` (see :meth:`Spill.get`)."""
        t = self.spill.get(self._keys[name], part, shape)
        return t if self.device is None else t.to(self.device)

    def __contains__(self, name):
        return name in self._keys  # without reading the tensor (Mapping's default would)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


def input_grams(job, i: int, prefix: str) -> Stored:
    """RegMean's statistic of model ``i``: per linear weight of the anchor's report, the Gram
    ``Σ x xᵀ`` (float64) of its input over ``job.data``, with the model carried into the
    anchor's basis. ``job``: a :class:`~symgraph.merging.engine.statistics.StatisticsContext`
    (the checkpoints, alignments, budget, ledger and spill). Summed over the processes under
    ``torch.distributed``."""
    A, ra = job.ckpts[job.anchor], job.graph_report
    view = Aligned(job.ckpts[i], job.alignments[i], A, ra, job.resources.work_dtype, job.resources.cache_bytes, job.resources.ledger)
    device = job.resources.device
    keys: dict = {}
    for (rep,), batches in by_shape((ra,), (A.model,), job.data):
        layers = rep.linear_layers()
        order = {name: pos for pos, (name, _, _) in enumerate(rep.nodes())}
        users: dict = {}  # input node -> the weights that read it
        # a linear map reading a graph input directly gets no Gram (every model's would be the
        # data's own, the same for all: RegMean is then their weighted average, what the
        # combine does for a weight without statistics); the op-by-op run yields computed nodes only
        given = {n.name for n in rep.exported_program.graph.nodes if n.op == "placeholder"}
        for w, x, _, layout in layers:
            if x in order and x not in given:
                users.setdefault(x, []).append((w, layout))
        width = {x: A.model.get_parameter(ws[0][0]).shape[1 if ws[0][1] == "out_in" else 0]
                 for x, ws in users.items()}
        key = {x: f"{prefix}{min(w for w, _ in ws)}" for x, ws in users.items()}
        keys.update((w, key[x]) for x, ws in users.items() for w, _ in ws)
        fetch = view.fetch if device == "cpu" else (lambda n: view.fetch(n).to(device))
        _, runs = op_by_op(rep, batches, fetch, device)
        for todo in _passes(sorted(users, key=lambda n: order.get(n, -1)), width, job.resources.stats_bytes):
            grams = {x: torch.zeros(width[x], width[x], dtype=torch.float64, device=device) for x in todo}
            job.resources.ledger.hold(sum(nbytes(g) for g in grams.values()))
            for step, flat in bar(runs, desc="statistics", unit="batch"):
                with torch.no_grad():
                    for name, val in step.steps(flat, set(todo), stop=todo[-1]):
                        X = val.double().reshape(-1, val.shape[-1])
                        grams[name] += X.T @ X
            grams = distributed.all_reduce_dict(grams)
            for x, g in grams.items():  # a batch shape traced again adds to the first shape's Grams
                job.spill.put({key[x]: g + job.spill.get(key[x]) if key[x] in job.spill else g})
            job.resources.ledger.drop(sum(nbytes(g) for g in grams.values()))
            del grams
        runs.clear()
    view.clear()
    return Stored(job.spill, keys, None if device == "cpu" else device)


def _passes(xs, width, budget):
    """The input nodes (in graph order) cut into passes of about ``budget`` bytes of float64
    Grams (at least one node each)."""
    out, size = [[]], 0
    for x in xs:
        n = 8 * width[x] ** 2
        if out[-1] and size + n > budget:
            out.append([])
            size = 0
        out[-1].append(x)
        size += n
    return [p for p in out if p]

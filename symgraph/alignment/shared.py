"""Weight matching shared between processes (``torch.distributed``), bit for bit one process's.

Run under ``torchrun`` with a process group of more than one process initialised
(:func:`symgraph.core.distributed.is_active`), :meth:`~.sweeps.Sweeps.run` hands the units a
sweep solves to :class:`Waves` rather than solving each at once:

* **Waves of independent units.** Consecutive units of the sweep's order none of which reads
  (through the slots of its similarity, the classes its groups are fibred over, or its
  transport masses) a class another unit of the wave solves make a *wave*: solved in any
  order, they find what one process finds solving them one after the other (a unit's skip and
  deferral tests, and the first sweep's ``usable`` slots, read only the classes it reads).
  Each unit has one owner rank for the whole alignment (largest first onto the least loaded
  rank, by the parameter sizes of its slots): the owner computes its similarity and solves it;
  the outcomes (what it used, elements, solver results) are all-gathered and every rank sets
  them in the sweep's order. A unit's similarity caches live on its owner only, and only the
  owner reads them, so a cached contribution is added where one process adds it.
  A unit whose similarity may pool contributions (:meth:`~.weights.WeightFeatures._poolable`)
  keeps them within a byte budget shared by all classes: a wave holds at most one such unit,
  and the bytes its owner's pools took or freed are all-gathered with its outcome, so each
  keep-or-drop decision sees the budget one process's sees.
* **Sums over classes, split by slot.** A unit that reads the classes of two or more other
  units (the residual stream: a sum of contributions from every layer) is solved alone, by
  every rank together: the slot contributions
  that are not cached are split between the ranks (by size), all-gathered, and every rank sums
  all of them in one process's order and keeps the same caches and pools, so no
  floating-point sum is reordered (an all-reduce would be: it adds per-rank partial sums).
  The owner alone calls the solver; its elements are all-gathered like a wave's. The
  contributions are gathered a few per rank at a time, as the sum reads them.

In one process with one host solver thread (:data:`symgraph.solve.turns.THREADS`) :class:`Waves`
solves each unit as it is added: the loop is unchanged. With several, it forms the same waves
(the pool rule aside: the units' similarities, and so the pools' keep-or-drop decisions, run in
the sweep's order) and solves a wave's units through :func:`~symgraph.solve.turns.in_turn`:
one at a time in the wave's order, their host assignment solves overlapping; the outcomes are
set in that order, so the elements are the sequential loop's, bit for bit.
"""
from __future__ import annotations

import io
from functools import partial

import torch
import torch.distributed as dist

from ..core import distributed
from ..solve import turns

__all__ = ["Waves", "split_slots", "gather"]


class Waves:
    """Collects a sweep's unit solves into waves (several processes) or solves them at once."""

    def __init__(self, run, last: dict, stable: set):
        self.run, self.last, self.stable = run, last, stable
        self.active = distributed.is_active()
        self.local = not self.active and turns.THREADS > 1  # one process: waves, solves at once
        self.items: list = []  # [(unit index, pending ids, sweep)]
        self.solving: set = set()  # group ids the wave solves
        self.solo = self.pooling = False  # a unit solved by all ranks; one that may keep pools
        self.solved_here: set = set()  # group ids of the units this rank solved
        self.slots = [0, 0]  # slot contributions computed here, by all ranks (collective units)
        if self.active or self.local:
            self._plan()

    def _plan(self) -> None:
        """What each unit reads (other than its own classes), which units read the classes of
        two or more others (collective), which may keep pools and, several processes, each
        unit's owner."""
        run, feats = self.run, self.run.feats
        n = len(run.units)
        ids = [run.ids(u) for u in run.units]
        self.reads: list = []
        self.collective: set = set()
        self.pools: set = set()  # units whose similarity may keep pools
        cost = []
        for ui, unit in enumerate(run.units):
            reads, c, pools = set(), 0, False
            for g in run.solved_groups(unit):
                for name, d in feats.slots(g):
                    dep = feats.deps(g, name, d)
                    reads |= dep
                    c += feats.numel(name) if self.active else 0  # (a lazy mapping reads it)
                    pools |= unit.kind == "single" and feats._poolable(dep, False, False)
            for g in unit.groups(run.opts.selected):
                reads.update(g.outer)
            if run.masses is not None and unit.outer is not None:
                reads |= run.masses.deps(unit.outer)
            reads -= ids[ui]
            self.reads.append(frozenset(reads))
            cost.append(c)
            if pools:
                self.pools.add(ui)
            if sum(1 for v in range(n) if v != ui and ids[v] & reads) >= 2:
                self.collective.add(ui)
        k = distributed.world_size()
        self.owner: dict = {}
        load = [0] * k
        for ui in sorted((u for u in range(n) if u not in self.collective), key=lambda u: (-cost[u], u)):
            r = min(range(k), key=lambda r: (load[r], r))
            self.owner[ui] = r
            load[r] += cost[ui]
        for j, ui in enumerate(sorted(self.collective)):
            self.owner[ui] = j % k

    def before(self, ui: int) -> None:
        """Solve the wave first if unit ``ui`` cannot join it (it reads what the wave solves, or
        it or the wave is collective; several processes: both may keep pools)."""
        if (self.active or self.local) and self.items and (
                self.solo or ui in self.collective or self.reads[ui] & self.solving
                or (self.active and ui in self.pools and self.pooling)):
            self.flush()

    def add(self, ui: int, pending: set, sweep: int) -> None:
        """Unit ``ui`` is solved next (``pending``: the classes not yet solved in the first sweep)."""
        if not (self.active or self.local):
            self.run._resolve(ui, pending, self.last, self.stable, sweep)
            return
        self.items.append((ui, set(pending), sweep))
        self.solving |= self.run.ids(self.run.units[ui])
        self.solo = ui in self.collective
        self.pooling |= ui in self.pools

    def flush(self) -> None:
        """Solve the wave: each unit on its owner (a collective unit's similarity on every
        rank), then every rank sets every outcome in the order the units were added; one
        process: its units in turn (:func:`~symgraph.solve.turns.in_turn`), outcomes in order."""
        items, self.items, self.solving, self.solo, self.pooling = self.items, [], set(), False, False
        if not items:
            return
        if self.local:  # one process: similarities in order, host solves overlapping
            run = self.run
            outs = turns.in_turn([partial(run._compute, run.units[ui], pending) for ui, pending, _ in items])
            for (ui, _, sweep), (record, outcome) in zip(items, outs):
                run._finish(ui, record, outcome, self.last, self.stable, sweep)
            return
        run, me = self.run, distributed.rank()
        feats = run.feats
        mine = {}
        for ui, pending, _ in items:
            unit = run.units[ui]
            if ui in self.collective:
                run.feats.share = self._split
                try:
                    got = run._compute(unit, pending, solve=self.owner[ui] == me)
                finally:
                    run.feats.share = None
            elif self.owner[ui] == me:
                kept = feats._pool_bytes
                got = (*run._compute(unit, pending), feats._pool_bytes - kept)
            else:
                continue
            if self.owner[ui] == me:
                mine[ui] = got
                self.solved_here |= run.ids(unit)
        outcomes: dict = {}
        for d in gather(mine):
            outcomes.update(d)
        for ui, _, sweep in items:
            record, outcome, *kept = outcomes[ui]
            if kept and self.owner[ui] != me:
                feats._pool_bytes += kept[0]  # the pool budget is shared by all classes' pools
            run._finish(ui, record, outcome, self.last, self.stable, sweep)

    def _split(self, tasks: list) -> "_Chunks":
        return _Chunks(tasks, self.slots)

    def summary(self) -> dict:
        """``{}`` in one process; else the ranks, this rank, the owner of each unit (by its
        first group id), the group ids this rank solved and the slot contributions of
        collective units computed here and by all ranks."""
        if not self.active:
            return {}
        first = [min(self.run.ids(u)) for u in self.run.units]
        return {"ranks": distributed.world_size(), "rank": distributed.rank(),
                "owners": {first[ui]: r for ui, r in sorted(self.owner.items())},
                "collective": sorted(first[ui] for ui in self.collective),
                "solved_here": sorted(self.solved_here), "slots_here": self.slots[0],
                "slots": self.slots[1]}


class _Chunks:
    """``{key: value}`` of a similarity's slot tasks, computed :data:`CHUNK` per rank at a time
    as :meth:`~.weights.WeightFeatures.similarity` reads them (in the tasks' order; the chunk
    before is dropped), so that memory holds a few contributions, not all of them at once."""

    CHUNK = 2

    def __init__(self, tasks: list, count: list):
        self.tasks, self.count, self.at = tasks, count, 0
        self.got: dict = {}

    def __getitem__(self, key):
        while key not in self.got:
            if self.at >= len(self.tasks):
                raise KeyError(key)
            n = self.CHUNK * distributed.world_size()
            got = split_slots(self.tasks[self.at:self.at + n])
            self.at += n
            self.count[0] += sum(1 for *_, here in got.values() if here)
            self.count[1] += len(got)
            self.got = {k: v for k, (v, *_) in got.items()}
        return self.got[key]


def split_slots(tasks: list) -> dict:
    """``tasks``: ``[(key, cost, compute)]``, the same list on every rank; each rank calls the
    ``compute()`` of its share (largest first onto the least loaded rank) and the results are
    all-gathered: ``{key: (value, cost, owner rank, computed here)}`` on every rank."""
    k, me = distributed.world_size(), distributed.rank()
    load, owner = [0] * k, {}
    for i in sorted(range(len(tasks)), key=lambda i: (-tasks[i][1], i)):
        r = min(range(k), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += tasks[i][1]
    mine = {i: tasks[i][2]() for i in range(len(tasks)) if owner[i] == me}
    values: dict = {}
    for d in gather(mine):
        values.update(d)
    return {tasks[i][0]: (values[i], tasks[i][1], owner[i], owner[i] == me) for i in range(len(tasks))}


def gather(obj) -> list:
    """``obj`` of every rank, in rank order. Tensors keep their bits; a CUDA tensor comes back on
    this rank's current CUDA device (each rank holds its elements on its own device), others
    where they were."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    everyone: list = [None] * distributed.world_size()
    dist.all_gather_object(everyone, buf.getvalue())
    return [torch.load(io.BytesIO(b), map_location=_here, weights_only=False) for b in everyone]


def _here(storage, location: str):
    if location.startswith("cuda") and torch.cuda.is_available():
        return storage.cuda(torch.cuda.current_device())
    return storage

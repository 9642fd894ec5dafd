"""Squared gradients of a whole model taken out of core: the engine's
:class:`~symgraph.merging.engine.statistics.SquaredGradients` (Fisher's statistic).

The anchor's traced graph is cut into segments of consecutive ops, each reading at most about
a budget of weights (:mod:`.segments`), and run with gradient checkpointing, one segment at a
time: 1. **forward**, without gradients, keeping each batch's values crossing the next cut;
2. **backward**, segments in reverse: the segment's weights read again as leaves, each batch's
segment recomputed from its kept inputs and differentiated with the gradients the later
segment left (the last starts from the declared loss on the graph's first output); each
weight's batch gradient squared and summed in the work dtype (a weight several segments read,
a tied embedding and head, has its batch gradient summed over them first, as autograd sums a
tied parameter's), and a weight whose every reader is done written to disk and freed.

Memory holds one segment's weights and sums and one batch's activations within it, whatever
the depth. The ops are the traced graph's own, so the gradients are the eager model's.
"""
from __future__ import annotations

import math

import torch

from ...alignment.checks import batch_inputs, by_shape
from ...core import distributed
from ...core.progress import bar
from .segments import Graph, Kept, Segment, backward_span, output_node, plan_segments
from .sums import Stored
from .views import Aligned, nbytes

__all__ = ["squared_gradients", "plan_segments", "budget_floor"]


def squared_gradients(ctx, i: int, kind, prefix: str) -> Stored:
    """Model ``i``'s ``Σ_batches (∂ loss / ∂ w)²`` per parameter in the work dtype (float32 sums
    are within ``batches · 2⁻²⁴`` of the exact, at half the bytes), ``loss`` the ``kind``'s on
    ``ctx.data``, in the anchor's basis: measured on the aligned model where norm gains fold
    (which no map of the sums expresses), else in the model's own basis and moved by
    ``kind.to_anchor``. ``ctx``: a :class:`~.statistics.StatisticsContext`; summed over the
    processes under ``torch.distributed``; written to ``ctx.spill`` as each weight is done."""
    A, ra, res = ctx.ckpts[ctx.anchor], ctx.graph_report, ctx.resources
    al = ctx.alignments[i]
    folded = al is not None and bool(ra.folds)
    view = Aligned(ctx.ckpts[i], al if folded else None, A, ra, res.work_dtype, res.cache_bytes, res.ledger)
    done = _Done(ctx, kind, None if folded else al, prefix)
    for (rep,), batches in by_shape((ra,), (A.model,), ctx.data):
        graph = _Segmented(rep, batches, view, A, res.device, res.work_dtype, res.stats_bytes)
        kept = _forward(graph, res, ctx.spill, f"{prefix}cuts/{len(done.keys)}/")
        _backward(graph, kept, kind, res, done)
    view.clear()
    done({p: None for p in set(A.param_of.values()) - set(done.keys)})  # parameters no op reads: zero, as in memory
    return Stored(ctx.spill, done.keys, None if res.device == "cpu" else res.device)


class _Segmented(Graph):
    """The graph traced for one batch shape (``rep``) cut into ``segments`` of about
    ``stats_bytes`` of weights, gradients and sums each; ``readers``: parameter -> the segments
    that read it; ``flats``: each batch's inputs."""

    def __init__(self, rep, batches, view, A, device, work_dtype, stats_bytes: int):
        super().__init__(rep.exported_program, device)
        self.view = view
        self.canon = lambda n: A.param_of.get(n, n)  # a tied parameter's names -> one
        self.grads = {n for n in self.params if n in A.param_of}
        acc = torch.empty((), dtype=work_dtype).element_size()
        cost = {n: t.numel() * (2 * t.element_size() + acc) for n, t in self.params.items()}  # weight, grad, sum
        self.segments = plan_segments(self.gm, cost, max(1, stats_bytes))
        self.readers: dict = {}
        for k, (a, b) in enumerate(self.segments):
            for n in self.attributes(a, b):
                if n in self.grads:
                    self.readers.setdefault(self.canon(n), set()).add(k)
        self.flats = [self.inputs(*batch_inputs(rep, batch, bi)) for bi, batch in batches]
        self.first = output_node(next(n for n in self.order if n.op == "output"))

    def read(self, a, b, leaves: bool) -> dict:
        """The weights segment [a, b) reads; tied names share one tensor (one leaf, whose
        gradient autograd sums over its uses)."""
        w, by = {}, {}
        for n in self.attributes(a, b):
            if n not in self.lazy or n in w:
                continue
            if self.canon(n) not in by:
                t = self.view.fetch(n)
                t = t if self.device == "cpu" else t.to(self.device)
                by[self.canon(n)] = t.detach().requires_grad_(True) if (
                    leaves and n in self.grads and t.is_floating_point()) else t
            w[n] = by[self.canon(n)]
        return w


def _forward(graph: _Segmented, res, spill, prefix: str) -> Kept:
    """1. forward, without gradients: the values crossing each cut, per batch."""
    kept = Kept(res.ledger, res.stats_bytes // 2, spill, graph.device, prefix)

    def read(a, b):
        w = graph.read(a, b, False)
        return w, sum(nbytes(t) for t in w.values())
    graph.forward(graph.segments, graph.flats, read, res.ledger, kept)
    return kept


def _backward(graph: _Segmented, kept: Kept, kind, res, done) -> None:
    """2. backward, segments in reverse: each segment recomputed from its kept inputs and
    differentiated, each weight's batch gradient squared into its sum, and a weight whose every
    reader is done given to ``done``."""
    acc = torch.empty((), dtype=res.work_dtype).element_size()
    up: list[dict] = [{} for _ in graph.flats]  # per batch: node -> gradient at the current cut
    pending: list[dict] = [{} for _ in graph.flats]  # per batch: a multi-segment weight's summed gradient
    sums: dict = {}
    shown = bar(total=len(graph.segments) * len(graph.flats), desc="squared gradients", unit="step")
    for k in range(len(graph.segments) - 1, -1, -1):
        a, b = graph.segments[k]
        w = graph.read(a, b, True)
        mine = {graph.canon(n) for n in w if n in graph.grads}
        for p in mine:
            sums.setdefault(p, None)
        uniq = {id(t): t for t in w.values()}  # tied names share a tensor
        holds = sum(nbytes(t) + (acc * t.numel() if t.requires_grad else 0) for t in uniq.values())
        res.ledger.hold(holds)
        run = Segment(graph.gm, w)
        leaf = {graph.canon(n): t for n, t in w.items() if n in graph.grads and t.requires_grad}
        for j, flat in enumerate(graph.flats):
            last = (lambda env: kind.loss(env[graph.first])) if b == len(graph.order) else None
            up[j] = backward_span(run, kept.pop(j, k) if k else {}, a, b, None if k else flat, up[j], last)
            for p, t in leaf.items():
                g, t.grad = t.grad, None
                if g is not None:
                    _accumulate(sums, pending[j], graph.readers.get(p, ()), p, k, g, res.work_dtype)
            shown.update()
        done({p: sums.pop(p) for p in mine if min(graph.readers.get(p, {k})) == k})
        res.ledger.drop(holds)
        del w, run, leaf
    shown.close()


def _accumulate(sums: dict, pending: dict, readers, p, k: int, g, dtype) -> None:
    """Batch gradient ``g`` of parameter ``p`` at segment ``k`` squared into ``sums[p]``; a weight
    several segments read (``readers``) has its batch gradient summed over them first
    (``pending``, until its first reader), as autograd sums a tied parameter's."""
    if len(readers) > 1:
        g = g if p not in pending else pending.pop(p) + g
        if min(readers) < k:
            pending[p] = g
            return
    if sums[p] is None:
        sums[p] = torch.zeros(g.shape, dtype=dtype, device=g.device)
    _add_square(sums[p], g)


def _add_square(acc, g, step: int = 1 << 21):
    """``acc += g²`` in ``acc``'s dtype, a slice at a time (a mixed-dtype op copies its
    inputs into the common dtype whole: two copies of a large gradient)."""
    a, g = acc.view(-1), g.detach().reshape(-1)
    for i in range(0, a.numel(), step):
        x = g[i:i + step]
        a[i:i + step].addcmul_(x, x)


class _Done:
    """Called with finished sums (``{parameter: sum}``; None: zero): summed over the processes,
    moved into the anchor's basis by ``alignment`` (None: measured there), added to the
    context's spill and named in ``keys``."""

    def __init__(self, ctx, kind, alignment, prefix: str):
        self.ctx, self.kind, self.alignment, self.prefix = ctx, kind, alignment, prefix
        self.keys: dict = {}

    def __call__(self, done: dict) -> None:
        if not done:
            return
        ctx, res = self.ctx, self.ctx.resources
        A, spill = ctx.ckpts[ctx.anchor], ctx.spill
        full = {p: s if s is not None else torch.zeros(A.model.get_parameter(p).shape, dtype=res.work_dtype,
                                                       device=res.device) for p, s in done.items()}
        full = distributed.all_reduce_dict(full)
        if self.alignment is not None:
            full = self.kind.to_anchor(full, self.alignment)
        put = {}
        for p, s in full.items():
            key = f"{self.prefix}{p}"
            put[key] = s + spill.get(key).to(s.device) if key in spill else s
            for alias in A.params.get(p, (p,)):
                self.keys.setdefault(alias, key)
            self.keys.setdefault(p, key)
        spill.put(put)


def budget_floor(ctx) -> tuple:
    """``(bytes, name)``: the smallest memory budget :func:`squared_gradients` holds its
    largest op in (its weights and their sums, beside the values at the cuts, a quarter of
    the budget, and the models' caches, a quarter), and a weight that op reads."""
    A, ep = ctx.ckpts[ctx.anchor], ctx.graph_report.exported_program
    acc = torch.empty((), dtype=ctx.resources.work_dtype).element_size()
    params = ep.graph_signature.inputs_to_parameters
    best = (0, None)
    for node in ep.graph.nodes:
        names = {params[a.name] for a in node.all_input_nodes if a.name in params}
        cost = sum(math.prod(A.shapes[A.key(n)]) * (A.dtypes[A.key(n)].itemsize + acc) for n in names)
        best = max(best, (cost, min(names, default=None)), key=lambda t: t[0])
    n = len(ctx.ckpts)
    return -(-best[0] * 4 * n // (3 * n - 1)), best[1]

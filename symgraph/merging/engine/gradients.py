"""Squared gradients of a whole model taken out of core: the engine's
:class:`~symgraph.merging.engine.statistics.SquaredGradients` (Fisher's statistic).

The anchor's traced graph is cut into **segments** of consecutive ops, each reading at most
about a budget of weights, the cuts placed where the fewest activation bytes cross (between
layers, on the residual stream). Gradient checkpointing, one segment at a time:

1. **forward**, without gradients: for each segment, its weights read once, every batch run
   through it, and the values crossing the next cut kept (about one residual stream per batch
   and cut);
2. **backward**, segments in reverse: the segment's weights read again as leaves that take
   gradients, each batch's segment recomputed from its kept inputs and differentiated with the
   gradients the later segment left at its outputs (the last segment starts from the
   declared loss on the graph's first output, the logits); each weight's gradient of each
   batch is squared and summed in the work dtype (float32; float64 for float64 models) — a
   weight read by several segments (a tied embedding and head) has its batch gradient summed
   over them first, as autograd sums a tied parameter's — and a weight whose every reader
   is done is written to disk and freed.

Memory holds one segment's weights, their sums and one batch's activations within
the segment, whatever the model's depth. The ops are the traced graph's own, so the
gradients are those of the eager model (the tests compare them); each value is computed the
same way in the recomputation as in the forward pass. The cutting, the segments' runs and the
values kept at the cuts are :mod:`.segments`' (learned matching out of core runs on them too).
"""
from __future__ import annotations

import math

import torch

from ...alignment.checks import batch_inputs, by_shape
from ...alignment.graphrun import flatten_for, runnable
from ...core import distributed
from .segments import Kept, Segment, backward_span, live_after, output_node, plan_segments
from .sums import Stored
from .views import Aligned, nbytes

__all__ = ["squared_gradients", "plan_segments", "budget_floor"]


def squared_gradients(job, i: int, kind, prefix: str) -> Stored:
    """Model ``i``'s ``Σ_batches (∂ loss / ∂ w)²`` per parameter (in the work dtype: float32 sums
    of squares are within ``batches · 2⁻²⁴`` of the exact, and a 1.1B model's 32000-row embedding
    then holds 262 MB of sums, not 524), ``loss`` the ``kind``'s
    (:class:`~symgraph.merging.engine.statistics.SquaredGradients`: ``kind.loss`` of the graph's
    first output) on ``job.data``, measured in the anchor's basis: on the aligned model where
    norm gains fold (B's gains carried into A's, which no map of the sums expresses), else in
    the model's own basis and moved by ``kind.to_anchor`` (the squared map). ``job``: a
    :class:`~symgraph.merging.engine.statistics.StatisticsContext`. Segments of the traced graph are run forward
    and backward one at a time (see the module's docstring); summed over the processes
    under ``torch.distributed``; written to ``job.spill`` as each weight is done."""
    A, ra = job.ckpts[job.anchor], job.graph_report
    al = job.alignments[i]
    folded = al is not None and bool(ra.folds)
    view = Aligned(job.ckpts[i], al if folded else None, A, ra, job.resources.work_dtype, job.resources.cache_bytes, job.resources.ledger)
    canon = lambda n: A.param_of.get(n, n)  # noqa: E731 - a tied parameter's names -> one
    params = set(A.param_of)
    device = job.resources.device
    keys: dict = {}
    for (rep,), batches in by_shape((ra,), (A.model,), job.data):
        gm = runnable(rep.exported_program.module(), device)
        named = dict(gm.named_parameters(remove_duplicate=False))
        grads = {n for n in named if n in params}
        item = {n: t.element_size() for n, t in named.items()}
        acc = torch.empty((), dtype=job.resources.work_dtype).element_size()
        cost = {n: t.numel() * (2 * item[n] + acc) for n, t in named.items()}  # weight, grad, sum
        segments = plan_segments(gm, cost, max(1, job.resources.stats_bytes))
        readers: dict = {}  # parameter -> the segments that read it
        order = list(gm.graph.nodes)
        for k, (a, b) in enumerate(segments):
            for node in order[a:b]:
                for x in node.all_input_nodes:
                    if x.op == "get_attr" and x.target in grads:
                        readers.setdefault(canon(x.target), set()).add(k)
        flats = []
        for bi, batch in batches:
            args, kwargs = batch_inputs(rep, batch, bi)
            flats.append([t.to(device) if isinstance(t, torch.Tensor) else t for t in flatten_for(gm, args, kwargs)])
        out_node = next(n for n in order if n.op == "output")
        first = output_node(out_node)

        lazy = set(named) | {n for n, _ in gm.named_buffers(remove_duplicate=False)}
        pos = {n: p for p, n in enumerate(order)}

        def read(a, b, leaves):
            """The weights segment [a, b) reads; tied names share one tensor (one leaf, whose
            gradient autograd sums over its uses)."""
            w, by = {}, {}
            for node in order[a:b]:
                for x in node.all_input_nodes:
                    n = x.target
                    if x.op != "get_attr" or n not in lazy or n in w:
                        continue
                    if canon(n) not in by:
                        t = view.fetch(n)
                        t = t if device == "cpu" else t.to(device)
                        by[canon(n)] = t.detach().requires_grad_(True) if (
                            leaves and n in grads and t.is_floating_point()) else t
                    w[n] = by[canon(n)]
            return w

        # 1. forward: the values crossing each cut, per batch
        kept = Kept(job.resources.ledger, job.resources.stats_bytes // 2, job.spill, device, f"{prefix}cuts/{len(keys)}/")
        with torch.no_grad():
            for k, (a, b) in enumerate(segments[:-1]):
                w = read(a, b, False)
                job.resources.ledger.hold(sum(nbytes(t) for t in w.values()))
                run = Segment(gm, w)
                for j, flat in enumerate(flats):
                    env = run.span(kept.get(j, k) if k else {}, a, b, None if k else flat)
                    kept.put(j, k + 1, {n: v for n, v in env.items() if live_after(pos, n, b)})
                job.resources.ledger.drop(sum(nbytes(t) for t in w.values()))
                del w, run
        # 2. backward, segments in reverse
        up: list[dict] = [{} for _ in flats]  # per batch: node -> gradient at the current cut
        pending: list[dict] = [{} for _ in flats]  # per batch: a multi-segment weight's summed gradient
        sums: dict = {}
        for k in range(len(segments) - 1, -1, -1):
            a, b = segments[k]
            w = read(a, b, True)
            mine = {canon(n) for n in w if n in grads}
            for p in mine:
                sums.setdefault(p, None)
            uniq = {id(t): t for t in w.values()}  # tied names share a tensor
            holds = sum(nbytes(t) for t in uniq.values()) + sum(acc * t.numel() for t in uniq.values()
                                                                if t.requires_grad)
            job.resources.ledger.hold(holds)
            run = Segment(gm, w)
            leaf = {canon(n): t for n, t in w.items() if n in grads and t.requires_grad}
            for j, flat in enumerate(flats):
                last = (lambda env: kind.loss(env[first])) if b == len(order) else None
                up[j] = backward_span(run, kept.pop(j, k) if k else {}, a, b, None if k else flat, up[j], last)
                for p, t in leaf.items():
                    g, t.grad = t.grad, None
                    if g is None:
                        continue
                    if len(readers.get(p, ())) > 1:
                        g = g if p not in pending[j] else pending[j].pop(p) + g
                        if min(readers[p]) < k:
                            pending[j][p] = g
                            continue
                    if sums[p] is None:
                        sums[p] = torch.zeros(g.shape, dtype=job.resources.work_dtype, device=g.device)
                    _add_square(sums[p], g)
            done = {p for p in mine if min(readers.get(p, {k})) == k}
            _finish(job, kind, al, folded, prefix, {p: sums.pop(p) for p in done}, params, keys, A)
            job.resources.ledger.drop(holds)
            del w, run, leaf
    view.clear()
    missing = {A.param_of[n] for n in params} - set(keys)  # parameters no op reads: zero, as in memory
    _finish(job, kind, al, folded, prefix, {p: None for p in missing}, params, keys, A)
    return Stored(job.spill, keys, None if device == "cpu" else device)


def _add_square(acc, g, step: int = 1 << 21):
    """``acc += g²`` in ``acc``'s dtype, a slice at a time (a mixed-dtype op copies its
    inputs into the common dtype whole: two copies of a large gradient)."""
    a, g = acc.view(-1), g.detach().reshape(-1)
    for i in range(0, a.numel(), step):
        x = g[i:i + step]
        a[i:i + step].addcmul_(x, x)


def _finish(job, kind, al, folded, prefix, done: dict, params, keys, A):
    """The finished sums (None: zero) summed over the processes, moved into the anchor's
    basis, written to the spill (adding to what an earlier batch shape wrote) and named."""
    if not done:
        return
    full = {}
    for p, s in done.items():
        shape = A.model.get_parameter(p).shape
        full[p] = s if s is not None else torch.zeros(shape, dtype=job.resources.work_dtype, device=job.resources.device)
    full = distributed.all_reduce_dict(full)
    if not folded and al is not None:
        full = kind.to_anchor(full, al)
    put = {}
    for p, s in full.items():
        key = f"{prefix}{p}"
        put[key] = s + job.spill.get(key).to(s.device) if key in job.spill else s
        for alias in A.params.get(p, (p,)):
            keys.setdefault(alias, key)
        keys.setdefault(p, key)
    job.spill.put(put)


def budget_floor(job) -> tuple:
    """``(bytes, name)``: the smallest memory budget :func:`squared_gradients` holds its
    largest op in, and a weight that op reads, from the anchor's graph (no alignment needed).
    The backward pass holds a segment's weights as read and their gradients' sums (a segment
    is one op where one op reads more than the statistics' half of the budget), beside the
    values kept at the cuts (at most a quarter of the budget) and the read weights' cache (a
    quarter split over the models): the op must fit in the rest."""
    A, ep = job.ckpts[job.anchor], job.graph_report.exported_program
    acc = torch.empty((), dtype=job.resources.work_dtype).element_size()
    params = ep.graph_signature.inputs_to_parameters
    best = (0, None)
    for node in ep.graph.nodes:
        names = {params[a.name] for a in node.all_input_nodes if a.name in params}
        cost = sum(math.prod(A.shapes[A.key(n)]) * (A.dtypes[A.key(n)].itemsize + acc) for n in names)
        best = max(best, (cost, min(names, default=None)), key=lambda t: t[0])
    n = len(job.ckpts)
    return -(-best[0] * 4 * n // (3 * n - 1)), best[1]

"""Similarity of a class from activations (Verma & Elbayad 2024's recipe): the graph is run on each data
batch, the outputs of ops whose rule is marked ``observe`` are captured where a class's
coordinates appear with only fixed classes beside them, and streamed cross-moments of A's and
B's coordinates give a correlation (permutations) or covariance (rotations) matrix. Under
``torch.distributed`` each process streams its own batches and the sums are all-reduced
(:mod:`symgraph.core.distributed`)."""
from __future__ import annotations

import math
import torch

from ..core import distributed
from ..core.finite import require_finite
from ..core.progress import bar
from .checks import batch_inputs, by_shape
from .graphrun import (GraphRunner, Stepper, flatten_for, lockstep, meta_constants, on_device, runnable,  # noqa: F401
                       run_capture, streamed_outputs)

__all__ = ["ActStats", "all_reduce_stats", "activation_similarity", "act_matrix", "run_capture",
           "GraphRunner", "Stepper", "lockstep", "on_device", "streamed_outputs"]


_SUMS = ("sa", "sb", "saa", "sbb", "sab")
#: The kinds whose similarity is a covariance, not a correlation: rotations (gl: its orthogonal part).
_ROTATIONS = ("orthogonal", "orthogonal_mean", "gl", "rope")


class ActStats:
    """Streaming cross-moments of one class's coordinates in A and B: ``n`` samples and the
    sums ``sa``, ``sb`` (``[F, n]``), ``saa``, ``sbb`` and ``sab`` (``[Fa, Fb, n, n]``),
    float64, None before the first sample."""

    def __init__(self):
        self.n = 0
        self.sa = self.sb = self.saa = self.sbb = None
        self._sab = None
        self._centred, self._means = None, []  # float32 part of sab not folded in yet (see add)
        self._shape = None  # ([Fa, n_A], [Fb, n_B]) of the samples behind _centred

    @property
    def sab(self):
        """``Σ a bᵀ`` in float64 (the float32 centred part and the means' outer products of
        16-bit samples folded in on first read)."""
        if self._centred is not None:
            k = len(self._means)
            ma = torch.stack([m for m, _ in self._means]).reshape(k, -1)  # [k, Fa·n]: each batch's sum / √t
            mb = torch.stack([m for _, m in self._means]).reshape(k, -1)
            (fa, na), (fb, nb) = self._shape
            part = self._centred.to(torch.float64).addmm_(ma.T, mb)  # [Fa·n, Fb·n]
            part = part.view(fa, na, fb, nb).permute(0, 2, 1, 3)  # [Fa, Fb, n, n]
            if fa > 1 or fb > 1:
                part = part.contiguous()
            self._sab = part if self._sab is None else self._sab.add_(part)
            self._centred, self._means = None, []
        return self._sab

    @sab.setter
    def sab(self, value):
        self._sab, self._centred, self._means = value, None, []

    def add(self, xa, xb, nf, work=torch.float64):
        """Samples ``xa [N, *F, n]``, ``xb``; sums in float64. ``work``: the dtype of the cross
        products (float32 for 16-bit activations: twice the float64 rate). Below float64 they
        are taken of each batch's centred samples and summed in that dtype, and the means'
        outer products are added in float64 when ``sab`` is read (``Σ a bᵀ = Σ (a − ā)(b − b̄)ᵀ
        + N ā b̄ᵀ`` per batch), so that a large mean does not cancel the covariance's digits."""
        # xa [N, *F, n] -> flatten fibres
        xa = xa.reshape(xa.shape[0], -1, xa.shape[-1]) if nf else xa.unsqueeze(1)
        xb = xb.reshape(xb.shape[0], -1, xb.shape[-1]) if nf else xb.unsqueeze(1)
        t = xa.shape[0]
        if work == torch.float64:
            xa, xb = xa.to(torch.float64), xb.to(torch.float64)
            sa, sb = xa.sum(0), xb.sum(0)
            saa, sbb, cross = (xa * xa).sum(0), (xb * xb).sum(0), torch.einsum("tai,tbj->abij", xa, xb)
            if self.sab is None:
                self.sab = cross
            else:
                self.sab.add_(cross)
        else:  # Σ a² = Σ c_a² + sa² / t and Σ a bᵀ as above, with c = x − x̄
            # one converted copy per side, centred in place. The sums are taken in ``work``: an
            # error δ in a batch's mean adds only t·δδᵀ to the covariance (the same sums centre
            # the samples and enter the means' outer products)
            ca, sa = _centred(xa, work)
            cb, sb = _centred(xb, work)
            # Σ c_a c_bᵀ accumulated by the matmul itself (C += AᵀB), kept as [Fa·n, Fb·n]
            a2, b2 = ca.reshape(t, -1), cb.reshape(t, -1)
            if self._centred is None:
                self._centred, self._shape = a2.T @ b2, (ca.shape[1:], cb.shape[1:])
            else:
                self._centred.addmm_(a2.T, b2)
            # squared in place: the converted copies are not read after the product
            saa = ca.square_().sum(0).to(torch.float64) + sa * sa / t
            sbb = cb.square_().sum(0).to(torch.float64) + sb * sb / t
            self._means.append((sa / t ** 0.5, sb / t ** 0.5))
        if self.sa is None:
            self.sa, self.sb, self.saa, self.sbb = sa, sb, saa, sbb
        else:  # in place
            for name, x in (("sa", sa), ("sb", sb), ("saa", saa), ("sbb", sbb)):
                getattr(self, name).add_(x)
        self.n += t

    def release(self):
        """Drop the sums (``n`` stays, telling that the class was observed)."""
        self.sa = self.sb = self.saa = self.sbb = self.sab = None

    def all_reduce(self) -> "ActStats":
        """Sum ``n`` and the sums over all processes (:func:`all_reduce_stats`); returns
        ``self``."""
        all_reduce_stats({0: self})
        return self

    def matrix(self, kind):
        n = max(self.n, 1)
        ma, mb = self.sa / n, self.sb / n
        # in place on one copy of sab (a 11008-wide MLP's is 1 GB in float64)
        cov = (self.sab / n).sub_(ma[:, None, :, None] * mb[None, :, None, :])
        if kind in _ROTATIONS:
            return cov
        sa = (self.saa / n - ma * ma).clamp_min(1e-12).sqrt()
        sb = (self.sbb / n - mb * mb).clamp_min(1e-12).sqrt()
        return cov.div_(sa[:, None, :, None]).div_(sb[None, :, None, :])


def _centred(x, work):
    """``x`` converted to ``work`` (a copy) and centred in place on its own mean, with its sum
    in float64."""
    c = x.to(work, copy=True)
    s = c.sum(0)
    c.sub_(s / c.shape[0])
    return c, s.to(torch.float64)


def all_reduce_stats(stats: dict) -> dict:
    """``{key: ActStats}`` summed over all processes, in place (one reduction for all): a
    process without samples of a class (sums None) counts as zeros of the shapes the others
    have. A no-op when not distributed. Returns ``stats``."""
    if not distributed.is_active():
        return stats
    local = {}
    for i, s in stats.items():
        local[(i, "n")] = s.n
        local.update({(i, f): getattr(s, f) for f in _SUMS if getattr(s, f) is not None})
    total = distributed.all_reduce_dict(local)
    for i, s in stats.items():
        s.n = total[(i, "n")]
        for f in _SUMS:
            setattr(s, f, total.get((i, f)))
    return stats


def activation_similarity(ra, rb, data, pairs, models=None, max_samples=4096, fetch=None,
                          on_done=None, budget=None, device=None):
    """Streamed statistics ``{i: ActStats}`` for each ``(group A, group B)`` of ``pairs`` at
    its observation points (ops whose rule is marked ``observe``), over ``data``. Batches of
    other shapes than the traced ones are traced again when ``models`` (A, B) are given.
    A's and B's graphs run side by side, op by op (:class:`Stepper`): a captured output is
    kept only until its counterpart in the other model is computed. ``fetch``: two functions
    ``name -> tensor`` giving each model's parameters and buffers on the CPU, read when an op
    needs one and dropped after it (out of core: the graphs may be traced on ``meta``); None
    runs the graphs' own tensors. ``device``: where the graphs run with ``fetch`` (the CPU when
    None): the fetched tensors and the batches are moved there, so that the statistics are on
    the device of the weight similarities they are solved with.

    ``on_done(indices, stats)``, with ``budget`` (bytes): the pairs are taken in passes over
    the data, in the order their last observation point is computed, each pass holding
    statistics of about ``budget`` bytes and running the graphs only as far as its last point;
    after each pass ``on_done`` gets the indices it completed (and may :meth:`ActStats.release`
    them), so that memory holds one pass's statistics rather than every class's (a 7B model's
    MLP classes alone are 32 × 11008² cross-moments). Under ``torch.distributed`` ``data`` is this
    process's shard, and the statistics are summed over all processes before they are
    returned or given to ``on_done`` (every process must call it)."""
    stats = {i: ActStats() for i in range(len(pairs))}
    dev = torch.device(device if device is not None else "cpu")
    fa, fb = _fetchers(fetch, dev)
    shapes = _shapes(ra, rb, data, pairs, models, dev if fetch is not None else None)
    sa0, plan0, order0 = shapes[0][0], shapes[0][1], shapes[0][-1]
    passes = [list(range(len(pairs)))] if on_done is None else _passes(sa0, plan0, order0, pairs, budget)
    # Each pass resumes every batch's two runs where the last pass paused them (live values
    # kept), capturing every point of every class not complete yet: each op runs once per batch
    # over all passes, and a class's statistics live from its first point to its pass's end.
    runs: dict = {}  # (shape, batch) -> [Stepper A, Stepper B, A's inputs, B's inputs]
    reached = [-1] * len(shapes)  # per shape: the position of the last point run so far
    pending = set(range(len(pairs)))
    for todo in passes:
        for si, (sa, plan, views, gm_a, gm_b, batches, order) in enumerate(shapes):
            stop = max([order[a] for i in todo for a, _, _ in plan[i]] + [reached[si]])
            points = _points(plan, views, order, pending, reached[si], stop)
            reached[si] = stop
            if not points:
                continue
            in_order = sorted(points, key=lambda p: order[p[0]])
            last = in_order[-1] if len(passes) > 1 else (None, None)  # where the runs pause
            for bi, batch in bar(batches, desc=f"activation statistics (pass {passes.index(todo) + 1} of "
                                 f"{len(passes)})", unit="batch"):
                run = runs.get((si, bi))
                if run is None:
                    run = _new_run(sa, batch, bi, gm_a, gm_b, (fa, fb), dev if fetch is not None else None)
                    if last[0] is not None:  # paused: kept for the next pass
                        runs[(si, bi)] = run
                with torch.no_grad():
                    for point, xa, xb in _lockstep(run, points, in_order, last):
                        require_finite("activation statistics", f"the two models' outputs of op {point[0]!r} on "
                                       f"batch {bi} of the data", xa, xb)
                        _add(stats, points[point], xa, xb, max_samples)
        pending -= set(todo)
        all_reduce_stats({i: stats[i] for i in todo})
        if on_done is not None:
            on_done(todo, stats)
    runs.clear()  # the paused runs' live values
    return stats


def _fetchers(fetch, dev):
    """A's and B's ``name -> tensor`` on ``dev`` (None, None: the graphs' own tensors)."""
    if fetch is None:
        return None, None
    return tuple(fetch) if dev.type == "cpu" else tuple(lambda name, f=f: f(name).to(dev) for f in fetch)


def _new_run(sa, batch, bi, gm_a, gm_b, fetch, dev):
    """``[Stepper A, Stepper B, A's inputs, B's inputs]`` of one batch (moved to ``dev`` when
    not None: where the graphs run on fetched tensors)."""
    args, kwargs = batch_inputs(sa, batch, bi)
    flat = [flatten_for(gm, args, kwargs) for gm in (gm_a, gm_b)]
    if dev is not None:
        flat = [[t.to(dev) if isinstance(t, torch.Tensor) else t for t in f] for f in flat]
    return [Stepper(gm_a, fetch[0]), Stepper(gm_b, fetch[1]), *flat]


def _lockstep(run, points, in_order, last):
    """``(point, A's value, B's value)`` at each of ``points``, the two runs stepped side by
    side as far as ``last`` (None: to the end)."""
    step_a, step_b, in_a, in_b = run
    run_a = step_a.steps(in_a, {a for a, _ in points}, stop=last[0])
    run_b = step_b.steps(in_b, {b for _, b in points}, stop=last[1])
    return lockstep(run_a, run_b, in_order, drain=last[0] is not None)


def _shapes(ra, rb, data, pairs, models, dev):
    """Per shape of the batches: ``(A's report, plan, views, A's graph, B's graph, batches,
    A's node order)``, the reports traced at that shape (:func:`~.checks.by_shape`) and the
    graphs made runnable on ``dev`` in place (when not None: traced where the models were,
    maybe ``meta``)."""
    shapes = []
    for (sa, sb), batches in by_shape((ra, rb), models, data):
        spairs = [(sa.groups[ga.id], sb.groups[gb.id]) for ga, gb in pairs]
        plan, views = _plan(sa, sb, spairs)
        gm_a = sa.exported_program.module()
        gm_b = gm_a if sb is sa else sb.exported_program.module()  # a Stepper keeps its own state
        if dev is not None:
            for gm in (gm_a,) if gm_b is gm_a else (gm_a, gm_b):
                runnable(gm, dev)  # in place
        order = {name: pos for pos, (name, _, _) in enumerate(sa.nodes())}
        shapes.append((sa, plan, views, gm_a, gm_b, batches, order))
    return shapes


def _points(plan, views, order, pending, reached, stop):
    """``{(node in A, node in B): [(pair index, its views)]}``: the observation points of the
    pairs not complete yet (``pending``) after position ``reached`` up to ``stop``."""
    points: dict = {}
    for i in sorted(pending):
        for node_a, node_b, _ in plan[i]:
            if reached < order[node_a] <= stop:
                points.setdefault((node_a, node_b), []).append((i, views[(i, node_a)]))
    return points


_WIDE = (torch.float32, torch.float64)


def _add(stats, uses, xa, xb, max_samples):
    """One observation point's captures into the statistics of the pairs observed there."""
    for i, (va, vb, k) in uses:
        for (ia, fa), (ib, fb) in zip(va, vb):
            a = _act_gather(xa, k, ia, fa)
            b = _act_gather(xb, k, ib, fb)
            if a.shape[0] > max_samples:
                sel = torch.linspace(0, a.shape[0] - 1, max_samples, device=a.device).long()
                a, b = a[sel], b[sel]
            # the cross products at the activations' precision: float64 for float32/64 graphs,
            # float32 for 16-bit ones (whose values hold 8-11 bits), centred so that no mean cancels
            work = torch.float64 if torch.promote_types(a.dtype, b.dtype) in _WIDE else torch.float32
            stats[i].add(a, b, fa, work)


def _passes(sa, plan, order, pairs, budget):
    """The pair indices in passes: ordered by their last observation point in A's graph
    (``order``: node name -> position), cut where a pass's cross-moments (``[Fa, Fb, n, n]``
    float64) would pass ``budget`` bytes."""
    last = {i: max((order[a] for a, _, _ in plan[i]), default=-1) for i in plan}
    out, size = [[]], 0
    for i in sorted(plan, key=lambda i: (last[i], i)):
        ga = pairs[i][0]
        fibres = math.prod(sa.fibre_shape(ga.id)) if ga.outer else 1
        nbytes = 8 * (fibres * ga.size) ** 2
        if out[-1] and budget is not None and size + nbytes > budget:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _plan(ra, rb, pairs):
    """Observation points per pair ``{i: [(node in A, node in B, dim)]}`` and the index views
    of each class's coordinates there."""
    plan = {}
    nodes_a, nodes_b = ra.nodes(), rb.nodes()
    for i, (ga, gb) in enumerate(pairs):
        pts = []
        for pos, name_b, k in rb.observation_points(gb.id):
            if pos >= len(nodes_a) or nodes_a[pos][2] != nodes_b[pos][2]:
                continue
            pts.append((nodes_a[pos][0], name_b, k))
        plan[i] = pts
    views = {}
    for i, pts in plan.items():
        ga, gb = pairs[i]
        for node_a, node_b, k in pts:
            va = ra.leaf_views(ra.activation_axes(node_a)[k], ga.id)
            vb = rb.leaf_views(rb.activation_axes(node_b)[k], gb.id)
            need = len(ra.fibre_shape(ga.id))
            # heads on another axis of the tensor, or other leaves mixed in: not a clean view
            ok = [(x, y) for x, y in zip(va, vb)
                  if x[1] == need and x[0].dim() == need + 1 and y[0].dim() == x[0].dim()]
            views[(i, node_a)] = ([x for x, _ in ok], [y for _, y in ok], k)
    return plan, views


def _act_gather(x, k, idx, nf):
    """``x`` gathered along axis ``k`` by ``idx [*F, n, *O]`` → samples ``[N, *F, n]``.

    Every other axis of ``x`` and the other leaves ``O`` of the same axis count as samples.
    """
    moved = x.movedim(k, -1)
    g = moved[..., idx.reshape(-1).to(x.device)].reshape(*moved.shape[:-1], *idx.shape)
    n_o = idx.dim() - nf - 1
    if n_o:
        g = g.movedim(tuple(range(g.dim() - n_o, g.dim())), tuple(range(n_o)))
    keep = idx.shape[: nf + 1]
    return g.reshape(-1, *keep)


def act_matrix(stats, g, cross):
    if stats.n == 0:
        return None
    m = stats.matrix(g.kind)  # [Fa, Fb, n, n]
    if g.kind in _ROTATIONS and m.shape[0] > 1:
        n = max(stats.n, 1)
        va = (stats.saa / n - (stats.sa / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        vb = (stats.sbb / n - (stats.sb / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        m = m / (va[:, None, None, None] * vb[None, :, None, None])
    if g.outer or m.shape[0] > 1:
        return m if cross else torch.stack([m[h, h] for h in range(m.shape[0])])
    return m[0, 0]

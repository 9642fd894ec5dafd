"""Learned matching out of core: :func:`symgraph.alignment.refine.refine` on checkpoints, for
``symgraph merge --refine N`` in the merge engine
(:class:`~symgraph.merging.streaming.StreamingMerge`), no model loaded.

As in memory (:func:`symgraph.align` with ``refine``): model B is aligned to the anchor by
activations and by weights alone; the start is the one whose model halfway between them has
the lower mean loss on the first :data:`~symgraph.alignment.refine.START_BATCHES` batches;
each of the N steps draws ``λ ~ U(0.4, 0.6)`` from the same seeded generator, takes batch
``step mod len(data)`` and makes an Adam step on the loss of ``(1 − λ)·θ_A + λ·θ_B′``, B′
carried into A's basis by the current (learnable) elements (:func:`~symgraph.alignment.refine.learnable`);
the elements are projected back onto their groups, then full groups are fitted.

The loss is the model's own, ``labels = input_ids`` added for a language model as
:func:`~symgraph.alignment.refine.default_loss` adds them: the anchor's model (on ``meta``) is
traced with its labels, one graph per batch shape, and run in segments (:mod:`.segments`): a
forward pass keeps the values crossing each cut, then each segment, last first, is recomputed
from them with its weights a differentiable function of the elements,
``w = (1 − λ)·a + λ·move(b)``, each tensor computed from the two checkpoints' tensors read for
that segment (a norm fold's reader with its gain, shift and bias: :func:`~symgraph.transform.apply.move_piece`,
the values :func:`~symgraph.transform.apply.move` gives the whole model). Autograd sums each
element's gradient over the segments in one leaf per element; it is carried to the element's
parameters once per step. Buffers are the anchor's, as in memory. Memory holds the elements'
parameters and Adam's moments, one segment's tensors (the rest of half the memory budget) and
the values at the cuts (spilled to disk beyond a quarter of it).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from ..alignment.driver import align_tensors
from ..alignment.fullgroups import fit_full_groups
from ..alignment.graphrun import flatten_for, runnable
from ..alignment.options import AlignOptions
from ..alignment.refine import START_BATCHES, draw_lambda, learnable, summary, with_labels
from ..core.elements import Perm
from ..errors import InputError, NeedsMemory, TraceError
from ..passes.trace import output_positions, trace
from ..transform.apply import move_piece
from ..transform.folding import for_reader, members
from .segments import Kept, Segment, backward_span, live_after, output_node, plan_segments
from .slicing import identity_elements
from .statistics import Spill
from .views import elements_on, nbytes

__all__ = ["refined", "check_budget"]

GRAD = 8  # bytes per element of a moved tensor's gradient (float64)


def refined(job, i, ra, rb, views, gains, sides, acts):
    """Model ``i``'s alignment to the anchor by learned matching (``job.refine`` steps of
    ``job.refine_lr``): :func:`~symgraph.alignment.driver.align_tensors` on the job's
    :class:`~.views.Folded` ``views`` (A's, B's) by activations (``acts``: its options) and by
    weights, the better start refined; ``sides``: what full groups read (fitted after, as in
    memory)."""
    opts = dict(job.align_options)
    full = opts.pop("full_groups", False)
    solve = lambda **kw: align_tensors(ra, rb, *views, gains, exact_dtype=job.work_dtype, **kw, **opts)  # noqa: E731
    al = solve(**acts)
    t0 = time.perf_counter()
    starts = {"activations": al, "weights": solve()}
    for v in views:  # the folded caches are not read again: their budget goes to the segments
        v.clear()
    matching = _Matching(job, i)
    try:
        name, losses = matching.choose_start(starts)
        best = starts[name]
        best.seconds = {**al.seconds, "start": time.perf_counter() - t0}
        best.refined = matching.refine(best, job.refine, job.refine_lr)
        best.refined.update(start=name, start_loss=losses)
    finally:
        matching.close()
    if full:
        best.full_groups = fit_full_groups(best, sides, AlignOptions.build(None, **job.align_options))
    else:
        sides.release()
    return best


def loss_inputs(model, batch) -> dict:
    """The keyword inputs the model computes its own loss from: ``batch`` with ``labels =
    input_ids`` for a model with an output embedding (as
    :func:`~symgraph.alignment.refine.default_loss` adds them)."""
    if not isinstance(batch, dict):
        raise InputError(f"refine needs a loss, and {type(model).__name__} computes none from a batch of "
                         f"{type(batch).__name__}; expected batches of keyword tensors (language models: "
                         "labels = input_ids)")
    return with_labels(model, batch)


class _Graph:
    """The anchor's model traced with its loss on one batch shape, as segments."""

    def __init__(self, model, kw, device) -> None:
        try:
            ep, _, self.traced = trace(model, kw, decompose=False)
        except TraceError as e:  # the loaded model may still run it
            raise NeedsMemory(f"the model with its loss could not be traced ({str(e).splitlines()[0][:200]})") from None
        try:
            where = output_positions(ep, ["loss"])
        except InputError:
            raise InputError(f"refine needs a loss, and {type(model).__name__} computes none from its inputs "
                             "alone (language models do: labels = input_ids); expected a model that returns "
                             "a loss") from None
        gm = runnable(ep.module(), device)
        self.gm, self.order = gm, list(gm.graph.nodes)
        self.pos = {n: p for p, n in enumerate(self.order)}
        self.loss = output_node(next(n for n in self.order if n.op == "output"), min(where))
        self.params = dict(gm.named_parameters(remove_duplicate=False))
        self.lazy = set(self.params) | {n for n, _ in gm.named_buffers(remove_duplicate=False)}
        self.buffers = dict(gm.named_buffers(remove_duplicate=False))
        self.plans: dict = {}

    def flat(self, kw, device) -> list:
        full = {**{k: v for k, v in self.traced.items() if not isinstance(v, torch.Tensor)}, **kw}
        return [t.to(device) if isinstance(t, torch.Tensor) else t for t in flatten_for(self.gm, (), full)]

    def largest(self, cost) -> int:
        """The most bytes of tensors one op reads (the least a segment holds)."""
        return max(sum(cost.get(a.target, 0) for a in n.all_input_nodes if a.op == "get_attr") for n in self.order)

    def segments(self, cost, budget: int) -> list:
        if budget not in self.plans:
            self.plans[budget] = plan_segments(self.gm, cost, budget)
        return self.plans[budget]


class _Matching:
    """Model ``i`` of ``job`` between the anchor and its alignment, run in segments."""

    def __init__(self, job, i) -> None:
        self.job, self.A, self.B, self.device = job, job.ckpts[job.anchor], job.ckpts[i], job.device
        self.model = self.A.model  # on meta: traced, never run
        self.graphs: dict = {}  # batch shapes -> _Graph
        self.spill = Spill()  # the values at the cuts beyond the room: an empty directory until then
        self.room = job.stats_bytes // 2
        self.steps = 0

    def close(self):
        self.spill.close()

    def _use(self, al):
        """Read B through alignment ``al`` (its report, gains and keep names)."""
        self.rb = al.report_b
        self.gauge = {k: v.to(self.device) for k, v in al.gauge.items()} if al.gauge else None
        self.keep = {o: k for k, others in al.report_a.aliases.items() for o in others}
        self.folds = {m: f for f in self.rb.folds for m in members(f)}
        self.moved = set(self.rb.parameters)

    def _graph(self, batch):
        kw = loss_inputs(self.model, batch)
        shapes = tuple(sorted((k, tuple(v.shape)) for k, v in kw.items() if isinstance(v, torch.Tensor)))
        if shapes not in self.graphs:
            self.graphs[shapes] = _Graph(self.model, kw, self.device)
        g = self.graphs[shapes]
        return g, g.flat(kw, self.device)

    def _piece(self, key):
        """The tensors moved with ``key`` (its fold's part for it: gain, shift, reader, bias) and that fold."""
        f = self.folds.get(key)
        if f is None:
            return (key,), None
        f = for_reader(f, key)
        return members(f), f

    def _cost(self, g) -> dict:
        """Bytes a segment holds for each graph tensor: A's, the moved piece of B's (stored,
        float64 and its gradient) and the value between them; a buffer's own."""
        out = {}
        for n, t in list(g.params.items()) + list(g.buffers.items()):
            if n not in g.params or not t.is_floating_point():
                out[n] = t.numel() * t.element_size()
                continue
            key = self.keep.get(n, n)
            piece = self._piece(key)[0] if key in self.moved else ()
            sizes = [self.A.model.get_parameter(m) for m in piece]
            out[n] = 2 * t.numel() * t.element_size() + sum(p.numel() * (p.element_size() + 2 * GRAD) for p in sizes)
        return out

    def _weights(self, g, a, b, els, lam):
        """The tensors segment ``[a, b)`` reads of the model between A and B′ (tied names share
        one), and the bytes they took."""
        w, done, held = {}, {}, 0
        for node in g.order[a:b]:
            for x in node.all_input_nodes:
                n = x.target
                if x.op != "get_attr" or n not in g.lazy or n in w:
                    continue
                key = self.keep.get(n, n)
                if key not in done:
                    done[key], took = self._between(g, n, key, els, lam)
                    held += took
                w[n] = done[key]
        return w, held

    def _between(self, g, n, key, els, lam):
        if n not in g.params:  # a buffer: the anchor's, as functional_call leaves the module's own
            t = self.A.fetch(n).to(self.device)
            return t, nbytes(t)
        a = self.A.get(key, check=False).to(self.device)
        want = g.params[n].dtype
        if not a.is_floating_point():
            return a, nbytes(a)
        if want.is_floating_point and torch.finfo(a.dtype).bits < torch.finfo(want).bits:
            a = a.to(want)  # a narrower stored tensor in a wider graph (models stored in different dtypes)
        took = nbytes(a)
        b = a
        if key in self.moved:
            piece, fold = self._piece(key)
            raw = {m: self.B.get(m, check=False).to(self.device) for m in piece}
            moved = move_piece(self.rb, els, raw, fold, self.gauge)
            b = moved.get(key, raw[key]).to(a.dtype)
            took += sum(nbytes(t) for t in raw.values()) + sum(nbytes(t) * 2 for t in moved.values())
        w = (1 - lam) * a + lam * b  # as refine.linear: λ the weight of B′
        return w, took + nbytes(w)

    def _forward(self, g, segs, flats, els, lam, kept, keep: bool):
        """The segments run on every batch without gradients, each segment's tensors computed
        once: the values crossing each cut put in ``kept`` (``keep``: left there for a
        backward pass, which starts from the last segment, not run here); returns each
        batch's loss when every segment is run."""
        losses = [0.0] * len(flats)
        ledger = self.job.ledger
        with torch.no_grad():
            for k, (a, b) in enumerate(segs[:-1] if keep else segs):
                w, held = self._weights(g, a, b, els, lam)
                ledger.hold(held)
                run = Segment(g.gm, w)
                for j, flat in enumerate(flats):
                    start = (kept.get(j, k) if keep else kept.pop(j, k)) if k else {}
                    env = run.span(start, a, b, None if k else flat)
                    if b == len(g.order):
                        losses[j] = float(env[g.loss])
                    else:
                        kept.put(j, k + 1, {x: v for x, v in env.items() if live_after(g.pos, x, b)})
                    del env, start
                ledger.drop(held)
                del w, run
        return losses

    def choose_start(self, starts: dict):
        """:func:`~symgraph.alignment.refine.choose_start` out of core: the start (of ``{name:
        Alignment}``) whose midpoint model has the lowest mean loss on the first batches, and
        every start's loss."""
        data = list(self.job.data)[:START_BATCHES]
        losses = {}
        for name, al in starts.items():
            self._use(al)
            els = elements_on(al.elements, self.device)
            got: dict = {}
            for j, batch in enumerate(data):
                g, flat = self._graph(batch)
                got.setdefault(id(g), (g, []))[1].append((j, flat))
            values = [0.0] * len(data)
            for g, items in got.values():
                kept = Kept(self.job.ledger, self.room, self.spill, self.device, f"start/{name}/{id(g)}/")
                segs = g.segments(self._cost(g), max(1, self.job.stats_bytes))
                for (j, _), v in zip(items, self._forward(g, segs, [f for _, f in items], els, 0.5, kept, False)):
                    values[j] = v
            losses[name] = sum(values) / len(values)
        return min(losses, key=losses.__getitem__), losses

    def refine(self, al, steps: int, lr: float, seed: int = 0) -> dict:
        """:func:`~symgraph.alignment.refine.refine` out of core: ``al``'s elements optimised
        in place for ``steps`` steps; returns what happened, as it does."""
        data = self.job.data
        work = replace(al, elements=elements_on(al.elements, self.device))
        learn = learnable(al.report_a, work)
        if not learn:
            return {"steps": 0, "classes": 0}
        t0 = time.perf_counter()
        self._use(al)
        params = [p for x in learn.values() for p in x.params]
        # the parameters, their gradients and Adam's two moments; each element, its leaf and gradient
        state = _state(learn, work.elements)
        budget = max(1, self.job.stats_bytes - state)
        if self.job.memory_budget is not None:
            g, _ = self._graph(data[0])
            _check_room(self.job, state, g.largest(self._cost(g)))
        opt = torch.optim.Adam(params, lr=lr)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        self.job.ledger.hold(state)
        try:
            bar = tqdm(range(steps), desc="refine", unit="step", file=sys.stderr, leave=False,
                       disable=not self.job.progress or None)
            for step in bar:
                batch = data[step % len(data)]
                lam = draw_lambda(gen)
                live = {gid: x.element() for gid, x in learn.items()}
                leaves = {gid: e.detach().requires_grad_(True) for gid, e in live.items()}
                loss = self._step(batch, work.elements, leaves, lam, budget)
                opt.zero_grad()
                pairs = [(live[gid], t.grad) for gid, t in leaves.items() if t.grad is not None]
                if pairs:
                    torch.autograd.backward([e for e, _ in pairs], [gr for _, gr in pairs])
                opt.step()
                losses.append(loss)
                bar.set_postfix(loss=f"{loss:.4f}")
        finally:
            self.job.ledger.drop(state)
        for gid, x in learn.items():
            al.elements[gid] = elements_on({gid: x.final()}, "cpu")[gid]
        return summary(losses, steps, len(learn), time.perf_counter() - t0)

    def _step(self, batch, elements, leaves, lam, budget) -> float:
        """One batch's loss of the model between A and B′, differentiated segment by segment
        into ``leaves`` (``{group id: leaf}``, the learnable elements)."""
        g, flat = self._graph(batch)
        segs = g.segments(self._cost(g), budget)
        self.steps += 1
        kept = Kept(self.job.ledger, self.room, self.spill, self.device, f"refine/{self.steps}/")
        fixed = {**elements, **{gid: t.detach() for gid, t in leaves.items()}}
        self._forward(g, segs, [flat], fixed, lam, kept, True)
        els, got = {**elements, **leaves}, []
        up: dict = {}  # node -> gradients at the current cut

        def loss(env):
            got.append(env[g.loss])
            return got[-1]
        for k in range(len(segs) - 1, -1, -1):
            a, b = segs[k]
            with torch.enable_grad():
                w, held = self._weights(g, a, b, els, lam)
            self.job.ledger.hold(held)
            run = Segment(g.gm, w)
            up = backward_span(run, kept.pop(0, k) if k else {}, a, b, None if k else flat, up,
                               loss if b == len(g.order) else None)
            self.job.ledger.drop(held)
            del w, run
        return float(got[0].detach())


def _state(learn, elements) -> int:
    """Bytes of the learnable elements' parameters, their gradients and Adam's two moments, and
    of each element, its leaf and gradient."""
    return (4 * sum(nbytes(p) for x in learn.values() for p in x.params)
            + 3 * sum(_dense_bytes(elements[gid]) for gid in learn))


def _check_room(job, state: int, op: int) -> None:
    """Refuse a memory budget whose half (the statistics' share) cannot hold learned matching's
    ``state`` and its largest op, in human units with the smallest budget that works."""
    if state + op > job.stats_bytes:
        from ..checkpoints.outdir import human_bytes as hb
        need = 2 * (state + op)
        unit = 10 ** max(len(str(need)) - 3, 0)  # three digits, rounded up: the size shown works
        need = -(-need // unit) * unit
        raise InputError(f"learned matching holds {hb(state)} of learnable elements and their optimiser state, "
                         f"and {hb(op)} for its largest op: over half the memory budget "
                         f"({hb(2 * job.stats_bytes)}); expected --memory-budget of at least "
                         f"{hb(need)} (the smallest that works)")


def check_budget(job, report) -> None:
    """:func:`_check_room` before any alignment (``report``: the anchor's): the elements' sizes
    do not depend on their values, so identity elements give the state the solved ones will
    hold, and the anchor's graph with its loss gives the largest op."""
    if job.memory_budget is None or not job.refine or not job.data:
        return
    from types import SimpleNamespace
    eye = identity_elements(report)
    al = SimpleNamespace(report_a=report, report_b=report, gauge=None, elements=eye)
    learn = learnable(report, al)
    matching = _Matching(job, next(i for i in range(len(job.ckpts)) if i != job.anchor))
    try:
        matching._use(al)
        g, _ = matching._graph(job.data[0])
        _check_room(job, _state(learn, eye), g.largest(matching._cost(g)))
    finally:
        matching.close()


def _dense_bytes(e) -> int:
    """The bytes of element ``e`` as a float64 matrix (what a learnable element is)."""
    if isinstance(e, Perm):
        return e.index.numel() * e.index.shape[-1] * 8
    return e.numel() * 8

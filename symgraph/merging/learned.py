"""Learned matching out of core: :func:`symgraph.alignment.learning.learned_matching` on
checkpoints, for ``symgraph merge --refine N``, no model loaded. The start, the steps and the
record are learning's, as in memory; only how a loss and its gradient are computed is this
module's (:class:`_Matching`, an :class:`~symgraph.alignment.learning.Objective`).

The loss is the model's own (labels as :func:`~symgraph.alignment.refine.default_loss` adds
them): the anchor's model (on ``meta``) traced with its labels, one graph per batch shape, run
in segments (:mod:`.engine.segments`), each segment's weights ``w = (1 − λ)·a + λ·move(b)`` a
differentiable function of the elements, computed from the two checkpoints' tensors
(:func:`~symgraph.transform.apply.move_piece`). Each element's gradient is summed over the
segments in one leaf and carried to its parameters once per step. Memory holds the elements'
state, one segment's tensors (half the memory budget) and the values at the cuts (spilled to
disk beyond a quarter of it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..alignment.driver import align_tensors
from ..alignment.fullgroups import fit_full_groups
from ..alignment.learning import Objective, learnable, learned_matching
from ..alignment.options import AlignOptions
from ..alignment.refine import with_labels
from ..core.elements import elements_on
from ..errors import InputError, NeedsMemory, TraceError
from ..passes.trace import output_positions, trace
from ..transform.apply import move_piece
from ..transform.folding import for_reader, members
from .engine.segments import Graph, Kept, Segment, backward_span, output_node, plan_segments
from .engine.slicing import rounded_up
from .engine.sums import Spill
from .engine.views import Ledger, nbytes

__all__ = ["Learning", "refined", "check_budget"]

GRAD = 8  # bytes per element of a moved tensor's gradient (float64)


@dataclass(frozen=True)
class Learning:
    """What learned matching out of core takes of the merge engine."""

    anchor: Any  #: the anchor's checkpoint: its model (on meta) traced, never run; its tensors read
    data: list  #: the batches, keyword tensors
    steps: int  #: Adam steps
    lr: float  #: their size
    device: torch.device  #: where the segments run
    ledger: Ledger  #: the engine's bytes held
    room: int  #: bytes learned matching may hold: the statistics' share of the memory budget
    budgeted: bool  #: whether a memory budget was given (then ``room`` is checked before any alignment)
    work_dtype: torch.dtype  #: the alignment's exact dtype
    align_options: dict = field(default_factory=dict)  #: align_tensors' other options (full_groups included)
    progress: bool = True  #: a progress bar on a terminal


def refined(how: Learning, b, ra, rb, views, gains, sides, acts):
    """Checkpoint ``b``'s alignment to the anchor by learned matching: the better of
    :func:`~symgraph.alignment.driver.align_tensors` on the folded ``views`` by activations
    (``acts``: its options) and by weights refined; ``sides``: what full groups read."""
    opts: dict[str, Any] = dict(how.align_options)
    full = opts.pop("full_groups", False)
    fa, fb = views
    solve = lambda **kw: align_tensors(ra, rb, fa, fb, gains, **{"exact_dtype": how.work_dtype, **kw, **opts})  # noqa: E731
    al = solve(**acts)
    t0 = time.perf_counter()
    starts = {"activations": al, "weights": solve()}
    for v in views:  # the folded caches are not read again: their budget goes to the segments
        v.clear()
    matching = _Matching(how, b)
    try:
        best = learned_matching(starts, matching, how.data, how.steps, how.lr, t0, how.progress)
    finally:
        matching.close()
    if full:
        best.full_groups = fit_full_groups(best, sides, AlignOptions.build(None, **how.align_options))
    else:
        sides.release()
    return best


class _Graph(Graph):
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
        super().__init__(ep, device)
        self.loss = output_node(next(n for n in self.order if n.op == "output"), min(where))
        self.plans: dict = {}

    def batch(self, kw) -> list:
        return self.inputs((), {**{k: v for k, v in self.traced.items() if not isinstance(v, torch.Tensor)}, **kw})

    def largest(self, cost) -> int:
        """The most bytes of tensors one op reads (the least a segment holds)."""
        return max(sum(cost.get(a.target, 0) for a in n.all_input_nodes if a.op == "get_attr") for n in self.order)

    def segments(self, cost, budget: int) -> list:
        if budget not in self.plans:
            self.plans[budget] = plan_segments(self.gm, cost, budget)
        return self.plans[budget]


class _Between:
    """The tensors of the model between A and B′, B read through one alignment (its report,
    gains and A's tied names), each computed from the two checkpoints' stored tensors."""

    def __init__(self, A, B, al, device) -> None:
        self.A, self.B, self.device, self.rb = A, B, device, al.report_b
        self.gauge = {k: v.to(device) for k, v in al.gauge.items()} if al.gauge else None
        self.keep = {o: k for k, others in al.report_a.aliases.items() for o in others}
        # each folded tensor's part of its fold (gain, shift, reader, bias), found once
        self.pieces = {m: (members(r), r) for f in self.rb.folds for m in members(f) for r in [for_reader(f, m)]}
        self.moved = set(self.rb.parameters)

    def piece(self, key):
        """The tensors moved with ``key`` (its fold's part for it: gain, shift, reader, bias) and that fold."""
        return self.pieces.get(key, ((key,), None))

    def cost(self, g) -> dict:
        """Bytes a segment holds for each graph tensor: A's, the moved piece of B's (stored,
        float64 and its gradient) and the value between them; a buffer's own."""
        out = {}
        for n, t in list(g.params.items()) + list(g.buffers.items()):
            if n not in g.params or not t.is_floating_point():
                out[n] = t.numel() * t.element_size()
                continue
            key = self.keep.get(n, n)
            piece = self.piece(key)[0] if key in self.moved else ()
            sizes = [self.A.model.get_parameter(m) for m in piece]
            out[n] = 2 * t.numel() * t.element_size() + sum(p.numel() * (p.element_size() + 2 * GRAD) for p in sizes)
        return out

    def weights(self, g, a, b, els, lam):
        """The tensors segment ``[a, b)`` reads of the model between A and B′ (tied names share
        one), and the bytes they took."""
        w, done, held = {}, {}, 0
        for n in g.attributes(a, b):
            if n not in g.lazy or n in w:
                continue
            key = self.keep.get(n, n)
            if key not in done:
                done[key], took = self.tensor(g, n, key, els, lam)
                held += took
            w[n] = done[key]
        return w, held

    def tensor(self, g, n, key, els, lam):
        """Graph tensor ``n`` (stored as ``key``) of the model between A and B′, and the bytes it took."""
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
            piece, fold = self.piece(key)
            raw = {m: self.B.get(m, check=False).to(self.device) for m in piece}
            moved = move_piece(self.rb, els, raw, fold, self.gauge)
            b = moved.get(key, raw[key]).to(a.dtype)
            took += sum(nbytes(t) for t in raw.values()) + sum(nbytes(t) * 2 for t in moved.values())
        w = (1 - lam) * a + lam * b  # as refine.linear: λ the weight of B′
        return w, took + nbytes(w)


class _Matching(Objective):
    """Learned matching's losses out of core: checkpoint ``b`` between the anchor and its
    alignment, the anchor's traced graph run in segments."""

    def __init__(self, how: Learning, b) -> None:
        self.how, self.B = how, b
        self.graphs: dict = {}  # batch shapes -> _Graph
        self.spill = Spill()  # the values at the cuts beyond the room: an empty directory until then
        self.runs = 0  # steps run: each one's values at the cuts under its own names

    def close(self):
        self.spill.close()

    def working(self, elements: dict) -> dict:
        return elements_on(elements, self.how.device)

    def stored(self, elements: dict) -> dict:
        return elements_on(elements, "cpu")

    def _kept(self, prefix: str) -> Kept:
        return Kept(self.how.ledger, self.how.room // 2, self.spill, self.how.device, prefix)

    def _graph(self, batch):
        model = self.how.anchor.model  # on meta: traced, never run
        if not isinstance(batch, dict):
            raise InputError(f"refine needs a loss, and {type(model).__name__} computes none from a batch of "
                             f"{type(batch).__name__}; expected batches of keyword tensors (language models: "
                             "labels = input_ids), or from Python loss_fn(model, batch) -> scalar")
        kw = with_labels(model, batch)  # the inputs of the model's own loss, as default_loss adds them
        shapes = tuple(sorted((k, tuple(v.shape)) for k, v in kw.items() if isinstance(v, torch.Tensor)))
        if shapes not in self.graphs:
            self.graphs[shapes] = _Graph(model, kw, self.how.device)
        g = self.graphs[shapes]
        return g, g.batch(kw)

    def _forward(self, g, segs, flats, els, lam, kept, keep: bool):
        """:meth:`~.engine.segments.Graph.forward` on the model between A and B′; each batch's
        loss when every segment is run (not ``keep``)."""
        return g.forward(segs, flats, lambda a, b: self.between.weights(g, a, b, els, lam), self.how.ledger, kept,
                         keep, lambda env: float(env[g.loss]))

    def start_loss(self, al, batches: list) -> float:
        """The midpoint model's mean loss on ``batches``, the batches of one traced shape run together."""
        self.between = _Between(self.how.anchor, self.B, al, self.how.device)
        els = self.working(al.elements)
        got: dict = {}
        for j, batch in enumerate(batches):
            g, flat = self._graph(batch)
            got.setdefault(id(g), (g, []))[1].append((j, flat))
        values = [0.0] * len(batches)
        for g, items in got.values():
            kept = self._kept(f"start/{id(al)}/{id(g)}/")
            segs = g.segments(self.between.cost(g), max(1, self.how.room))
            for (j, _), v in zip(items, self._forward(g, segs, [f for _, f in items], els, 0.5, kept, False)):
                values[j] = v
        return sum(values) / len(values)

    def begin(self, al, elements: dict, learn: dict) -> None:
        """Hold the elements' state (:func:`_state`), refused (with a budget) where the room
        cannot hold it and the largest op."""
        self.state, self.elements = self._room_for(al, learn, elements), elements
        self.how.ledger.hold(self.state)

    def _room_for(self, al, learn, elements) -> int:
        """The bytes of the state of ``learn`` (:func:`_state`), B read through ``al``; with a
        budget, refused where the room cannot hold it and the first batch's largest op, naming
        the smallest budget that works."""
        self.between = _Between(self.how.anchor, self.B, al, self.how.device)
        state = _state(learn, elements)
        if not self.how.budgeted:
            return state
        g, _ = self._graph(self.how.data[0])
        op, room = g.largest(self.between.cost(g)), self.how.room
        if state + op > room:
            from ..checkpoints.outdir import human_bytes as hb
            need = rounded_up(2 * (state + op))
            raise InputError(f"learned matching holds {hb(state)} of learnable elements and their optimiser state, "
                             f"and {hb(op)} for its largest op: over half the memory budget "
                             f"({hb(2 * room)}); expected --memory-budget of at least "
                             f"{hb(need)} (the smallest that works)")
        return state

    def end(self) -> None:
        self.how.ledger.drop(self.state)

    def step(self, live: dict, batch, lam: float) -> float:
        """One batch's loss, differentiated segment by segment into a leaf per element, each
        leaf's gradient carried back through ``live`` into the element's parameters."""
        leaves = {gid: e.detach().requires_grad_(True) for gid, e in live.items()}
        g, flat = self._graph(batch)
        segs = g.segments(self.between.cost(g), max(1, self.how.room - self.state))
        self.runs += 1
        kept = self._kept(f"refine/{self.runs}/")
        self._forward(g, segs, [flat], {**self.elements, **{i: t.detach() for i, t in leaves.items()}}, lam, kept, True)
        els, got = {**self.elements, **leaves}, []
        up: dict = {}  # node -> gradients at the current cut

        def loss(env):
            got.append(env[g.loss])
            return got[-1]
        for k in range(len(segs) - 1, -1, -1):
            a, b = segs[k]
            with torch.enable_grad():
                w, held = self.between.weights(g, a, b, els, lam)
            self.how.ledger.hold(held)
            up = backward_span(Segment(g.gm, w), kept.pop(0, k) if k else {}, a, b, None if k else flat, up,
                               loss if b == len(g.order) else None)
            self.how.ledger.drop(held)
            del w
        pairs = [(live[gid], t.grad) for gid, t in leaves.items() if t.grad is not None]
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [gr for _, gr in pairs])
        return float(got[0].detach())


def _state(learn, elements) -> int:
    """Bytes of the learnable elements' parameters, their gradients and Adam's two moments, and
    of each element, its leaf and gradient."""
    return (4 * sum(nbytes(p) for x in learn.values() for p in x.params)
            + 3 * 8 * sum(math.prod(elements[gid].shape) for gid in learn))


def check_budget(how: Learning, eye) -> None:
    """Learned matching's room checked before any alignment, with ``eye``, the anchor's
    :func:`~.engine.slicing.identity_alignment`: the state's size does not depend on the elements' values."""
    if not how.budgeted or not how.steps or not how.data:
        return
    matching = _Matching(how, None)  # B is not read: the sizes are the anchor's
    try:
        matching._room_for(eye, learnable(eye.report_a, eye), eye.elements)
    finally:
        matching.close()


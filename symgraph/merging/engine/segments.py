"""A traced graph run op by op on each batch (:func:`op_by_op`: what the input Grams and REPAIR
run), or cut into segments and run one segment at a time, forward and backward (gradient
checkpointing out of core): what :mod:`.gradients` (squared gradients) and
:mod:`~symgraph.merging.learned` (learned matching) share.

:func:`plan_segments` cuts the graph's ops into segments that read at most about a budget of
weights, each cut where the fewest activation bytes cross. A :class:`Graph` is the traced
program made runnable, its forward pass run segment by segment (:meth:`Graph.forward`); a
:class:`Segment` runs an op range from the values crossing its first cut, its weights given by
the caller; :class:`Kept` holds the values crossing each cut per batch (spilled to disk beyond
its room); :func:`backward_span` recomputes a segment from its kept inputs as leaves and
differentiates it, from a loss (the last segment) or from the gradients the later segment left
at its outputs.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ...alignment.checks import batch_inputs
from ...alignment.graphrun import Stepper, flatten_for, runnable
from .views import nbytes

__all__ = ["plan_segments", "Graph", "Segment", "Kept", "backward_span", "leaf", "output_node", "live_after",
           "op_by_op", "flat_inputs"]


def flat_inputs(gm, args, kwargs, device) -> list:
    """A batch's flat inputs to ``gm``, on ``device``."""
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in flatten_for(gm, args, kwargs)]


def op_by_op(rep, batches, fetch, device) -> tuple:
    """``rep``'s traced graph made runnable on ``device`` and one op-by-op run of it per batch
    (``batches``: ``(index, batch)`` pairs), each weight read by ``fetch`` when an op takes it:
    ``(gm, [(Stepper, flat inputs)])``."""
    gm, runs = runnable(rep.exported_program.module(), device), []
    for bi, batch in batches:
        args, kwargs = batch_inputs(rep, batch, bi)
        runs.append((Stepper(gm, fetch), flat_inputs(gm, args, kwargs, device)))
    return gm, runs


def _val_bytes(node) -> int:
    v = node.meta.get("val") if hasattr(node, "meta") else None
    vals = v if isinstance(v, (tuple, list)) else [v]
    return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))


def plan_segments(gm, cost: dict, budget: int) -> list:
    """Cuts of ``gm``'s nodes (graph order) into segments ``(start, stop)`` whose weights cost
    (``cost``: graph attribute name -> bytes the segment holds for it) at most about
    ``budget`` (at least one op each); a cut is placed where the fewest bytes of activations
    cross it, from the traced shapes."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    last = {n: max((pos[u] for u in n.users), default=pos[n]) for n in order}
    # bytes crossing a cut before position c: values defined before c and used at or after it
    delta = [0] * (len(order) + 1)
    for n in order:
        if n.op == "get_attr":
            continue  # read by each segment that uses it, never carried
        if last[n] > pos[n]:
            b = _val_bytes(n)
            delta[pos[n] + 1] += b
            delta[last[n] + 1] -= b
    cross, run = [], 0
    for c in range(len(order) + 1):
        run += delta[c]
        cross.append(run)
    reads = [sum(cost.get(a.target, 0) for a in n.all_input_nodes if a.op == "get_attr") for n in order]
    cuts, held, first = [0], 0, None  # first: the segment's first op that reads weights
    for p in range(len(order)):
        if reads[p] and first is not None and held + reads[p] > budget:
            # op p would take the segment over the budget: cut at the cheapest place after the
            # segment's first read and before p at the latest (every segment reads weights,
            # at most the budget's or one op's)
            c = min(range(first + 1, p + 1), key=lambda q: (cross[q], -q))
            cuts.append(c)
            held = sum(reads[c:p])
            first = next((q for q in range(c, p) if reads[q]), None)
        if reads[p] and first is None:
            first = p
        held += reads[p]
    cuts.append(len(order))
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class Segment(Stepper):
    """``gm`` run over positions ``[start, stop)`` from the values crossing ``start``, its
    weights from ``weights`` (``name -> tensor``)."""

    def __init__(self, gm, weights):
        super().__init__(gm, weights.__getitem__)

    def span(self, env, start, stop, flat=None):
        self.env, self.args_iter = dict(env), iter(flat or ())
        for pos in range(start, stop):
            node = self._order[pos]
            if node.op == "output":  # the caller takes the outputs it needs from the values
                break
            self.env[node] = self.run_node(node)
            for dead in self.user_to_last_uses.get(node, ()):
                self.env.pop(dead, None)
        out, self.env = self.env, {}
        return out


class Graph:
    """The program of ``ep`` (an exported program) made runnable on ``device``: ``gm``, its
    nodes in ``order`` and their positions ``pos``, its ``params`` and ``buffers`` by name
    (``lazy``: both names, each read by the caller for the segments that take it)."""

    def __init__(self, ep, device) -> None:
        self.gm, self.device = runnable(ep.module(), device), device
        self.order = list(self.gm.graph.nodes)
        self.pos = {n: p for p, n in enumerate(self.order)}
        self.params = dict(self.gm.named_parameters(remove_duplicate=False))
        self.buffers = dict(self.gm.named_buffers(remove_duplicate=False))
        self.lazy = set(self.params) | set(self.buffers)

    def attributes(self, a, b) -> list:
        """The graph attributes (weights, buffers) the ops of segment ``[a, b)`` read, in order."""
        return [x.target for node in self.order[a:b] for x in node.all_input_nodes if x.op == "get_attr"]

    def inputs(self, args, kwargs) -> list:
        """A batch's flat inputs, on the device."""
        return flat_inputs(self.gm, args, kwargs, self.device)

    def forward(self, segments, flats, read, ledger, kept, keep: bool = True, last=None) -> list:
        """The ``segments`` run on every batch (``flats``) without gradients, each one's weights
        read once (``read(a, b) -> (weights, bytes)``): the values crossing each cut put in
        ``kept`` (``keep``: left there for a backward pass, the last segment not run), else
        every segment run and each batch's ``last(values)`` of the last returned."""
        out: list = [None] * len(flats)
        with torch.no_grad():
            for k, (a, b) in enumerate(segments[:-1] if keep else segments):
                w, held = read(a, b)
                ledger.hold(held)
                run = Segment(self.gm, w)
                for j, flat in enumerate(flats):
                    start = (kept.get(j, k) if keep else kept.pop(j, k)) if k else {}
                    env = run.span(start, a, b, None if k else flat)
                    if b == len(self.order):
                        out[j] = last(env)
                    else:
                        kept.put(j, k + 1, {x: v for x, v in env.items() if live_after(self.pos, x, b)})
                    del env, start
                ledger.drop(held)
                del w, run
        return out


def live_after(pos: dict, node, stop: int) -> bool:
    """Whether ``node``'s value is read at or after position ``stop`` (``pos``: node -> position)."""
    return any(pos[u] >= stop for u in node.users)


class Kept:
    """The values crossing each cut, per batch: held while they fit ``room`` bytes (counted in
    ``ledger``), the rest written to ``spill`` (a :class:`~symgraph.merging.engine.sums.Spill`;
    one file per batch and cut) and read back onto ``device`` when asked for. A model's depth
    then costs disk, not memory."""

    def __init__(self, ledger, room: int, spill, device, prefix: str):
        self.ledger, self.room, self.spill, self.device, self.prefix = ledger, room, spill, device, prefix
        self.mem: dict = {}  # (batch, cut) -> (env, bytes held)
        self.disk: dict = {}  # (batch, cut) -> (values not written, {node: key})

    def put(self, j, k, env):
        size = sum(nbytes(t) for v in env.values() for t in pytree.tree_leaves(v))
        if size <= self.room:
            self.room -= size
            self.ledger.hold(size)
            self.mem[j, k] = (env, size)
            return
        keys = {n: f"{self.prefix}{j}/{k}/{n.name}" for n, v in env.items() if isinstance(v, torch.Tensor)}
        # clones: views of one storage cannot share a safetensors file
        self.spill.put({keys[n]: env[n].detach().clone() for n in keys})
        self.disk[j, k] = ({n: v for n, v in env.items() if n not in keys}, keys)

    def get(self, j, k) -> dict:
        if (j, k) in self.mem:
            return self.mem[j, k][0]
        rest, keys = self.disk[j, k]
        return {**rest, **{n: self.spill.get(key).to(self.device) for n, key in keys.items()}}

    def pop(self, j, k) -> dict:
        env = self.get(j, k)
        if (j, k) in self.mem:
            size = self.mem.pop((j, k))[1]
            self.room += size
            self.ledger.drop(size)
        self.disk.pop((j, k), None)
        return env


def backward_span(run, kept: dict, start: int, stop: int, flat, up: dict, loss=None) -> dict:
    """Segment ``[start, stop)`` recomputed by ``run`` from ``kept`` (the values crossing its
    first cut; ``flat``: the graph's inputs, for the first segment) as leaves, differentiated
    from ``loss(env)`` (the last segment) or from ``up`` (``{node: [gradient per tensor]}`` the
    later segment left at its outputs); returns the gradients at its inputs (the next ``up``)."""
    with torch.enable_grad():
        inputs = {n: leaf(v) for n, v in kept.items()}
        env = run.span(inputs, start, stop, flat)
        if loss is not None:
            outs, gs = [loss(env)], [None]
        else:
            outs, gs = [], []
            for n, g in up.items():
                for v, gv in zip(pytree.tree_leaves(env.get(n)), g):
                    if gv is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                        outs.append(v)
                        gs.append(gv)
        if outs:
            torch.autograd.backward(outs, gs)
    got = {n: [t.grad if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(v)] for n, v in inputs.items()}
    return {n: g for n, g in got.items() if any(x is not None for x in g)}


def leaf(v):
    """A value crossing a cut as the next segment's input: its floating tensors (also inside
    tuples and lists, as multi-output ops give them) detached leaves that take gradients."""
    return pytree.tree_map(lambda t: t.detach().requires_grad_(True)
                           if isinstance(t, torch.Tensor) and t.is_floating_point() else t, v)


def output_node(out_node, position: int | None = None):
    """The graph node of the graph's flat output at ``position`` (None: its first node)."""
    flat, _ = pytree.tree_flatten(out_node.args[0])
    if position is None:
        return next(n for n in flat if isinstance(n, torch.fx.Node))
    return flat[position]

"""Driver: axis variables for every tensor in an exported graph, rules, union-find, fibres.

Soundness by construction: constants, graph inputs and graph outputs are fixed; an op without
a rule fixes every axis it touches and is recorded (``strict=True`` raises instead); an output
axis that a rule leaves unrelated is fixed too.

Buffers are data like constants, except that a floating-point buffer read only by ops whose
rules relate each of its axes (BatchNorm's running statistics) moves with those classes as a
parameter would (``buffer_nodes``); any other buffer is fixed, with the reason. A buffer
viewed or cropped before it is added (``bufferviews``) is judged along its chain of views.
"""
from __future__ import annotations

import operator

import torch

from ..errors import UnsupportedOpError
from . import labels, registry
from .bufferviews import buffer_views
from .deadcode import split_dead
from .patterns import rope as _rope
from .nodes import (BRANCHES_TAKEN, READ_AS_NUMBER, FrozenOp, flat_nodes as _flat_nodes, live_nodes, module_path,
                    output_nodes, packet as _packet, source_line, UNREAD, unread_parameters,
                    unsaved_tensors)
from .registry import Label, Meet, NoFiber, Rope, RuleContext, Structure, Unify
from .patterns.norms import find_norms
from .patterns.packed import find_packed
from .fibres import compute_fibres
from .uniform import is_zeros, uniform_axes, value_axes
from .unionfind import AxisUnionFind

__all__ = ['AxisAnalysis', 'FrozenOp', 'analyze_graph']

aten = torch.ops.aten

# Ops whose outputs carry no information from their tensor inputs but their shape/dtype.
CONST_OPS = {
    aten.arange, aten.full, aten.zeros, aten.ones, aten.empty, aten.scalar_tensor,
    aten.new_ones, aten.new_zeros, aten.new_full, aten.new_empty, aten.zeros_like,
    aten.ones_like, aten.full_like, aten.empty_like, aten.rand, aten.randn, aten.eye,
    aten.tril_indices, aten.triu_indices, aten.linspace, aten.empty_strided,
}
def _ints(x) -> list:
    """The ints of a nested list of them (a node's axes), in order."""
    return [x] if isinstance(x, int) else [i for y in x for i in _ints(y)] if isinstance(x, list) else []


# Stream groups a norm fold can open up.
WIDE = ("orthogonal", "orthogonal_mean")

# Ops with no tensor output worth an axis (asserts, metadata checks).
IGNORED = {aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size,
           aten.sym_constrain_range, aten._assert_async, aten.sym_size, aten.sym_numel,
           aten.sym_stride}


class AxisAnalysis:
    """Axis variables and constraints of one exported program, resolved into classes."""

    def __init__(self, ep, strict: bool = False, tied=(), fold_norms: bool = True,
                 skip_folds=frozenset(), keep=None):
        self.ep = ep
        self.keep = keep  # positions of the outputs a symmetry must keep (None: all)
        self.fold_norms = fold_norms
        self.skip_folds = skip_folds
        self.folds: list = []
        self.unobservable: set = set()
        self.tied = [list(t) for t in tied]
        self.aliases: dict[str, list] = {}
        self.graph = ep.graph_module.graph
        self.strict = strict
        self.uf = AxisUnionFind()
        self.node_axes: dict = {}
        self.origin: dict = {}
        self.frozen: list[FrozenOp] = []
        self.nofiber: list = []
        self.nofiber_why: dict = {}  # (axis, over) -> the op (and reason) that stated it
        sig = ep.graph_signature
        self.param_of = dict(sig.inputs_to_parameters)
        self.param_nodes: dict[str, torch.fx.Node] = {}
        self.buffer_of = dict(sig.inputs_to_buffers)
        self.unsaved = unsaved_tensors(ep)  # what a checkpoint does not store: fixed, as data
        self.buffer_nodes: dict[str, torch.fx.Node] = {}  # buffers no rule fixed (after run)
        self.buffer_views = buffer_views(self.graph, self.buffer_of)  # views of them taking rules
        self.fixed_buffers: dict[str, str] = {}  # the others: name -> why
        self.unread_why: str | None = None  # why every parameter is fixed (one is never read)
        self.dead: dict = {}  # unread parameters no method reads -> the proof's reason
        self.user_inputs = set(sig.user_inputs)
        self._constants = {n: ep.constants[k] for n, k in sig.inputs_to_lifted_tensor_constants.items()
                           if isinstance(ep.constants.get(k), torch.Tensor)}
        self.touched: dict = {}  # node reading a buffer -> the axes its rule's constraints mention
        self.labels: dict = {}  # node (or (node, i)) -> (axis, size): its values label that class
        self.stacked: dict = {}  # parameter name -> (o, j): viewed with axes o, j as one
        self.raw_axes: dict = {}  # and its stored axes
        self.shared: dict = {}  # leaf -> why it is not per member (stacked.MAX_STACKED)
        self._uniform: dict = {}  # node -> axes along which a constant does not vary (uniform)

    def constant_of(self, node):
        """A lifted constant's values (through copies of it), else None."""
        while node.op == "call_function" and _packet(node.target) in (
                torch.ops.aten.lift_fresh_copy, torch.ops.aten.clone, torch.ops.aten.alias):
            node = node.args[0]
        value = self._constants.get(node.name) if node.op == "placeholder" else None
        return None if value is None or value.is_meta else value  # traced on meta: values unknown

    # --- axes ----------------------------------------------------------------------------
    def _alloc(self, val):
        if isinstance(val, torch.Tensor):
            return [self.uf.new(int(s)) for s in val.shape]
        if isinstance(val, (list, tuple)):
            return [self._alloc(v) for v in val]
        return None

    def axes_of(self, node):
        return self.node_axes.get(node)

    def shape_of(self, node):
        v = node.meta.get("val")
        return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None

    def origin_of(self, node):
        return self.origin.get(node, "const")

    # --- main ----------------------------------------------------------------------------
    def run(self):
        for node in self.graph.nodes:
            self._classify(node)
        self._tie()
        claimed, cons, permuted = _rope.find_rope(self.graph, self.origin_of, self.axes_of, self.shape_of)
        self._apply(cons, None)
        normed, cons, self.folds, self.unobservable = find_norms(self, self.fold_norms, self.skip_folds)
        self.unobservable = set(self.unobservable) | permuted
        self._apply(cons, None)
        packed, cons = find_packed(self)
        self._apply(cons, None)
        claimed = claimed | normed | packed
        live = live_nodes(self.graph, self.keep)
        for node in self.graph.nodes:
            if node.op == "call_function" and _packet(node.target) in READ_AS_NUMBER:
                for a in self._all_axes(node.args[0]):  # a number the program branches on: an output
                    self.uf.meet(a, "identity", f"{node.name}: read as a number")
            elif node.op == "call_function" and node not in claimed and self.origin[node] == "act" \
                    and node in live:
                self._apply(labels.flow(self.labels, node), None)
                self._rule(node)
            elif node.op == "output":
                for i, out in enumerate(output_nodes(node)):
                    if out is None or (self.keep is not None and i not in self.keep):
                        continue
                    for a in self._all_axes(out):
                        self.uf.meet(a, "identity")
                    if out in self.labels:
                        self.uf.meet(self.labels[out][0], "identity", "labels in a graph output")
        self._settle_buffers()
        self._fix_unread(live)
        return self

    def _fix_unread(self, live):
        """A parameter the traced program never reads (:func:`.nodes.unread_parameters`: an audio
        tower text-only inputs never reach, a branch not taken) may be read elsewhere, what it
        needs unknown: every parameter stays as it is, the reason names it (not where). One the
        program reads but no kept output depends on (a pooler's output dropped), or one no method
        reads (``.deadcode``: :func:`.trace.trace` keeps them as ``DEAD``), alone stays."""
        meta = self.graph.owning_module.meta
        unread, self.dead = split_dead(meta[UNREAD] if UNREAD in meta else unread_parameters(self.ep), meta)
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        why = (f"{unread[0]}{more} is not read on the example inputs, traced with data-dependent branches: unknown"
               if meta.get(BRANCHES_TAKEN, False) else
               f"{unread[0]}{more} is never read by the traced inputs: pass inputs that use it") if unread else None
        self.unread_why = why
        for name, node in self.param_nodes.items():
            for a in self._all_axes(node) if unread or node not in live else ():
                self.uf.meet(a, "identity", why or (f"{name} is {self.dead[name]}" if name in self.dead else
                                                    f"parameter {name}: no output kept reads it on these inputs"))

    def _settle_buffers(self):
        """Keep a buffer movable only where every reader's rule related each of its axes; fix
        the others (and move them to ``fixed_buffers``)."""
        for name, node in list(self.buffer_nodes.items()):
            if (why := self._buffer_fixed(node)) is not None:
                self.fixed_buffers[name] = why
                del self.buffer_nodes[name]
                for a in self._all_axes(node):
                    self.uf.meet(a, "identity", f"buffer {name}: {why}")

    def _buffer_fixed(self, node):
        """Why ``node`` (a buffer) must stay as it is, or None when it may move."""
        if not (isinstance(v := node.meta.get("val"), torch.Tensor) and v.is_floating_point()):
            return "not a floating-point tensor"
        return self._readers_fixed(node) if node.users else "not read by the graph"

    def _readers_fixed(self, node):
        """Why some reader of ``node`` (a buffer or a view of one) leaves an axis unrelated."""
        axes = [a for a in self._all_axes(node) if self.uf.size[a] > 1]
        for user in node.users:
            if user not in self.touched:
                return f"read by {user.name} ({user.target}), which has no rule relating it"
            if any(a not in self.touched[user] for a in axes):
                return f"an axis not related by the rule of {user.name} ({user.target})"
            if user in self.buffer_views and (why := self._readers_fixed(user)) is not None:
                return why
        return None

    def _tie(self):
        """Tied parameters (one tensor, several names) are one set of axes and one slot."""
        for names in self.tied:
            nodes = [(n, self.param_nodes[n]) for n in names if n in self.param_nodes]
            if len(nodes) < 2:
                continue
            # report the tensor under its first name (model order: the embedding, not the
            # tied head), with the placeholder the graph actually uses (export routes every
            # use to one of them)
            keep = nodes[0][0]
            knode = max(nodes, key=lambda nn: len(nn[1].users))[1]
            for other, onode in nodes:
                if onode is not knode:
                    for a, b in zip(self.node_axes[knode], self.node_axes[onode]):
                        self.uf.union(a, b)
                if other != keep:
                    del self.param_nodes[other]
                    self.aliases.setdefault(keep, []).append(other)
            self.param_nodes[keep] = knode

    def _all_axes(self, node):
        return _ints(self.node_axes.get(node))

    def _classify(self, node):
        if node.op == "placeholder":
            self.node_axes[node] = self._alloc(node.meta.get("val"))
            name = self.param_of.get(node.name) or self.buffer_of.get(node.name)
            if node.name in self.param_of:
                self.origin[node] = "param"
                self.param_nodes[name] = node
            if node.name in self.user_inputs or name in self.unsaved and node.name in self.param_of:
                self.origin[node] = self.origin.get(node, "act")
                for a in self._all_axes(node):
                    self.uf.meet(a, "identity", self.unsaved.get(name))
            elif node.name in self.buffer_of and name not in self.unsaved:  # data a rule may relate
                self.origin[node] = "const"
                self.buffer_nodes[name] = node
                return  # its axes are settled after the rules (_settle_buffers)
            elif node.name not in self.param_of:  # lifted constants (and unsaved buffers): data we do not transform
                self.origin[node] = "const"
                if name in self.unsaved:
                    self.fixed_buffers[name] = self.unsaved[name]
        elif node.op == "call_function":
            if _packet(node.target) in IGNORED:
                self.origin[node] = "const"
                return
            self.node_axes[node] = self._alloc(node.meta.get("val"))
            if node in self.buffer_views:  # settled with its buffer (_settle_buffers)
                self.origin[node] = "act"
                return
            inputs = _flat_nodes(node.args) + _flat_nodes(list(node.kwargs.values()))
            if _packet(node.target) in CONST_OPS or all(
                    self.origin.get(i, "const") == "const" for i in inputs):
                self.origin[node] = "const"
            else:
                self.origin[node] = "act"
        else:
            self.origin[node] = "const"
        if self.origin[node] == "const" and not is_zeros(node):
            ax = self.node_axes.get(node)
            flat = isinstance(ax, list) and all(isinstance(a, int) for a in ax)
            same = uniform_axes(node, self._uniform) if flat and node.op == "call_function" else \
                value_axes(self.ep.constants.get(self.buffer_of.get(node.name, ""))) if flat else ()
            for j, a in enumerate(ax if flat else self._all_axes(node)):
                self.uf.meet(a, "perm" if j in same and flat else "identity",
                             f"{node.name}: a constant, the same along this axis" if j in same and flat
                             else self.unsaved.get(self.buffer_of.get(node.name)))

    def _rule(self, node):
        if node.target is operator.getitem:
            src, i = node.args
            sa = self.node_axes.get(src)
            if isinstance(sa, list) and i < len(sa) and isinstance(sa[i], list):
                for o, a in zip(self.node_axes[node] or [], sa[i]):
                    self.uf.union(o, a)
                if (src, i) in self.labels:
                    self.labels[node] = self.labels[src, i]
                return
        rule = registry.lookup(node.target)
        cons = None
        if rule is not None:
            ctx = RuleContext(node, self.axes_of, self.origin_of, self.uf.new, self.labels.get, self.constant_of)
            cons = rule(ctx)
        if cons is None:
            self._freeze_unknown(node)
            return
        bad = self._mismatched(cons)
        if bad:  # a rule that pairs axes of different sizes is wrong for this node: it says nothing
            self._freeze_unknown(node, f"the rule for {node.target} paired axes of sizes {bad[0]} and {bad[1]}")
            return
        self._apply(cons, node)

    def _mismatched(self, cons):
        """The sizes of the first two axes a :class:`Unify` of ``cons`` pairs that differ in
        size (a rule bug for this node's shapes), or None."""
        for c in cons:
            if isinstance(c, Unify):
                a, b = self.uf.size[self.uf.find(c.a)[0]], self.uf.size[self.uf.find(c.b)[0]]
                if a != b:
                    return a, b
        return None

    def _apply(self, cons, node):
        touched = set()
        for c in cons:
            if isinstance(c, Unify):
                self.uf.union(c.a, c.b, c.dual)
                touched |= {c.a, c.b}
            elif isinstance(c, Meet):
                self.uf.meet(c.axis, c.kind, c.reason)
                touched.add(c.axis)
            elif isinstance(c, Structure):
                self.uf.add_structure(c.axis, c.kind, c.parts)
                touched |= {c.axis, *c.parts}
            elif isinstance(c, NoFiber):
                self.nofiber.append((c.axis, c.over))
                where = f"{node.name} ({_packet(node.target)})" if node is not None else "a pattern"
                self.nofiber_why.setdefault((c.axis, c.over), f"{where}: {c.reason}" if c.reason else where)
            elif isinstance(c, Rope):
                self.uf.set_pairs(c.axis, c.pairs, "rotary position embedding")
                touched.add(c.axis)
            elif isinstance(c, Label):
                self.labels[node if c.out is None else (node, c.out)] = (c.axis, c.size)
        if node is not None:
            if any((i.op == "placeholder" and i.name in self.buffer_of) or i in self.buffer_views
                   for i in node.all_input_nodes):
                self.touched[node] = touched
            # safety net: an output axis no rule spoke of stays fixed
            for a in self._all_axes(node):
                if a not in touched and self.uf.size[a] > 1:
                    self.uf.meet(a, "identity", f"{node.name}: output axis not related by its rule")

    def _freeze_unknown(self, node, why=None):
        """Fix every axis ``node`` and its inputs carry and record it (``why``: a rule that
        failed on it; None: no rule)."""
        if self.strict:
            raise UnsupportedOpError(
                f"{why or f'no symmetry rule for {node.target}'} at node {node.name} "
                f"(module {module_path(node) or '<root>'}; {source_line(node)}). "
                "Register one with symgraph.passes.register, or analyse with strict=False "
                "to fix the axes it touches.")
        axes = self._all_axes(node)
        for i in _flat_nodes(node.args) + _flat_nodes(list(node.kwargs.values())):
            axes += self._all_axes(i)
        if not axes:  # no axis to fix (a check on a 0-d value: torch._check's _is_all_true)
            return
        reason = f"{node.name}: {why or f'no rule for {node.target}'}"
        for a in axes:
            self.uf.meet(a, "identity", reason)
        self.frozen.append(FrozenOp(str(node.target), node.name, module_path(node),
                                    source_line(node), axes, why or "no rule"))

    # --- results -------------------------------------------------------------------------
    def finalize(self):
        """Push kinds into structure parts, apply rope pairs, compute fibres."""
        uf = self.uf
        roots = {uf.find(a)[0] for a in range(len(uf.parent))}
        for r, pairs in list(uf.pairs.items()):
            uf.meet(r, "rope")
            self._split_pairs(r)
        # kinds flow from a structured class into its parts (largest first: parts are smaller)
        for r in sorted((r for r in roots if r in uf.struct), key=lambda r: -uf.size[r]):
            kind = uf.kind.get(r, "gl")
            why = next((w for k, w in reversed(uf.reasons.get(r, [])) if k == kind), "")
            for p, _par in uf.struct[r][1]:
                uf.meet(p, kind, f"part of a class narrowed to {kind} ({why})" if kind != "gl" else None)
        self.roots = {uf.find(a)[0] for a in range(len(uf.parent))}
        compute_fibres(self)
        return self

    def _split_pairs(self, r):
        """A rotary class that was later cut into parts: its elements are built from the
        parts', so hand each part the pairs inside it; a pair across a cut, or a product
        structure, leaves only the identity."""
        uf = self.uf
        r, _ = uf.find(r)
        s = uf.struct.get(r)
        if s is None or r not in uf.pairs:
            return
        pairs = uf.pairs.pop(r)
        kind, parts = s
        bounds, off = [], 0
        for p, _ in parts:
            n = uf.size[uf.find(p)[0]]
            bounds.append((off, off + n))
            off += n
        inside = [[(i - a, j - a) for i, j in pairs if a <= i < b and a <= j < b]
                  for a, b in bounds]
        if kind != "sum" or sum(map(len, inside)) != len(pairs):
            for p, _ in parts:
                uf.meet(p, "identity", "rotary pairs cut by a later split")
            return
        for (p, _), sub in zip(parts, inside):
            if sub:
                uf.set_pairs(p, sub, "rotary position embedding (a segment)")
                self._split_pairs(p)
            else:
                uf.meet(p, "identity", "segment of a rotary axis without pairs")

    def stream_kind(self, node):
        """The group kind of the last axis of ``node``'s output."""
        return self.kind(self.uf.find(self.node_axes[node][-1])[0])

    def kind(self, root):
        return self.uf.kind.get(root, "gl")

    def leaves(self, axis):
        """Leaf classes of an axis: itself, or the leaves of its structure's parts, in order
        (a walk, not a recursion: a structure may nest as deep as a time axis is long)."""
        return [r for r, _ in self.uf.leaves(axis)]


def analyze_graph(ep, strict=False, tied=(), fold_norms=True, keep=None) -> AxisAnalysis:
    """Analyse ``ep``. A norm gain is folded only where that widens its stream's group beyond
    permutations (elsewhere, e.g. a stream read by a tied head, the fold would change the
    weights for nothing): folds that did not are dropped and the graph analysed again."""
    an = AxisAnalysis(ep, strict, tied, fold_norms, keep=keep).run().finalize()
    by_name = {n.name: n for n in an.graph.nodes}
    useless = frozenset(f.node for f in an.folds if an.stream_kind(by_name[f.node]) not in WIDE)
    if useless:
        an = AxisAnalysis(ep, strict, tied, fold_norms, useless, keep).run().finalize()
    return an

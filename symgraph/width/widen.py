"""A model's own traced program with some of its classes resized: the circuit-space model of
an architecture whose config cannot state a wider head (GPT-2 derives the head size from the
width).

The analysis knows every node's axes as classes, so the size of every tensor in the graph
follows from the new sizes of a few classes (:meth:`~symgraph.report.SymmetryReport.resized_shapes`).
The pass rewrites the ops whose arguments carry sizes (``view``, ``reshape``, ``expand``,
``split``, full ``slice``\\ s) to those shapes, keeps each attention op's softmax scale as the
parents had it, and then runs the rewritten program once, checking every node's shape
against the classes': an op that carries a resized size some other way (an ``arange`` or a
partial slice of a head) is refused by name, never guessed. Programs are traced per input
shape (the export is static) and kept.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from ..errors import InputError

__all__ = ["Resized", "rewrite"]

_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # template -> key -> shape -> program
_aten = torch.ops.aten
_SHAPE_ARG = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}
_SDPA = _aten.scaled_dot_product_attention.default


def _old_shape(node):
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return tuple(int(s) for s in v.shape)
    if isinstance(v, (list, tuple)):
        return [tuple(int(s) for s in x.shape) if isinstance(x, torch.Tensor) else None for x in v]
    return None


def rewrite(gm: torch.fx.GraphModule, old: dict, new: dict) -> torch.fx.GraphModule:
    """Rewrite ``gm``'s size arguments in place from the node shapes ``old`` to ``new``
    (``{node name: shape}``); refuses an op whose sizes it cannot rewrite."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SDPA:
            _keep_scale(node, old)
        if node.name not in new or new[node.name] == old.get(node.name):
            continue
        t, shape = node.target, new[node.name]
        if t in _SHAPE_ARG:
            node.args = (node.args[0], list(shape))
        elif t is _aten.expand.default:
            node.args = (node.args[0], [s if o != -1 else -1 for o, s in zip(node.args[1], shape)])
        elif t in (_aten.split.Tensor, _aten.split_with_sizes.default):
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            sizes = [s[dim] for s in shape]
            node.target = _aten.split_with_sizes.default
            node.args, node.kwargs = (node.args[0], sizes, dim), {}
        elif t is _aten.slice.Tensor:
            _full_slice(node, old, new)
    gm.recompile()
    return gm


def _full_slice(node, old, new):
    defaults = (None, 0, None, None, 1)  # slice.Tensor(self, dim=0, start=None, end=None, step=1)
    x, dim, start, end, step = tuple(node.args) + defaults[len(node.args):]
    was, now = old[x.name][dim], new[x.name][dim]
    if was == now:
        return
    if (start or 0) != 0 or step != 1 or (end is not None and end < was):
        raise InputError(f"{node.name} slices [{start}:{end}] of an axis that grows from {was} to {now}; a "
                         "partial slice of a resized class (a rotary half, a head) cannot be rewritten")
    node.args = (x, dim, 0, now if end == was else end, 1)


def _keep_scale(node, old):
    """Attention keeps the parents' softmax scale (1/√d of *their* head size unless given)."""
    if node.kwargs.get("scale") is None:
        q = old[node.args[0].name]
        node.kwargs = {**node.kwargs, "scale": 1.0 / math.sqrt(q[-1])}


class _ShapeCheck(torch.fx.Interpreter):
    def __init__(self, gm, want):
        super().__init__(gm)
        self.want = want

    def run_node(self, n):
        try:
            out = super().run_node(n)
        except Exception as e:  # an op whose arguments still carry the old sizes
            raise InputError(f"{n.name} ({n.target}) cannot run with the resized classes ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); it carries a size the graph pass does not rewrite") from None
        want = self.want.get(n.name)
        got = _old_shape_of(out)
        if n.op == "call_function" and want is not None and got is not None and _norm(got) != _norm(want):
            raise InputError(f"{n.name} ({n.target}) gives shape {got} where the resized classes give {want}; "
                             "it carries a size the graph pass does not rewrite")
        return out


def _old_shape_of(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in x):
        return [tuple(v.shape) for v in x]
    return None


def _norm(s):
    return [tuple(v) if v is not None else None for v in s] if isinstance(s, list) else tuple(s)


class Resized(torch.nn.Module):
    """``template``'s program with groups resized (``sizes(report) -> {group id: size}``) and
    the tensors ``state`` (the resized parameters and buffers, by the template's names).

    Traced once per input shape and checked (see the module docstring); ``template`` is read
    (traced), never changed. Runs in eval mode whatever its mode (dropout off)."""

    def __init__(self, template: torch.nn.Module, state: dict, sizes, why_not_saved: str, key=None):
        super().__init__()
        self._template = [template]  # not a submodule: its parameters are not this model's
        self.state = state
        self._sizes = sizes
        # programs are shared by every model of the same template and resizing (``key``)
        self._programs = _PROGRAMS.setdefault(template, {}).setdefault(key, {}) if key is not None else {}
        self._key_of_sizes = key
        self.why_not_saved = why_not_saved

    def with_state(self, state: dict) -> "Resized":
        """The same program on other tensors (differentiable ones, for learned matching)."""
        new = Resized(self._template[0], state, self._sizes, self.why_not_saved, self._key_of_sizes)
        if self._key_of_sizes is None:
            new._programs = self._programs
        return new.train(self.training)

    @property
    def config(self):
        """The template's config (its head size is derived, so it still describes this model)."""
        return getattr(self._template[0], "config", None)

    def get_output_embeddings(self):
        get = getattr(self._template[0], "get_output_embeddings", None)
        return get() if callable(get) else None

    def _inputs(self, args, kwargs):
        from ..passes.trace import split_inputs
        if args and kwargs:
            raise InputError("a circuit-space program takes positional or keyword inputs, not both")
        return split_inputs(self._template[0], args if args else kwargs)

    def _key(self, args, kwargs):
        leaves = pytree.tree_leaves((args, kwargs))
        return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves)

    def _program(self, args, kwargs):
        key = self._key(args, kwargs)
        if key not in self._programs:
            from ..report import analyze
            rep = analyze(self._template[0], args if args else kwargs)
            gm = rep.exported_program.module()
            old = {n.name: _old_shape(n) for n in rep.exported_program.graph_module.graph.nodes}
            new = rep.resized_shapes(self._sizes(rep))
            rewrite(gm, old, new)
            with torch.nn.utils.stateless._reparametrize_module(gm, self._state_for(gm)), torch.no_grad():
                _ShapeCheck(gm, new).run(*fx_pytree.tree_flatten_spec((args, kwargs), gm._in_spec))
            self._programs[key] = gm
        gm = self._programs[key]
        return gm, self._state_for(gm)

    def _state_for(self, gm) -> dict:
        names = set(gm.state_dict())
        return {k: v for k, v in self.state.items() if k in names}

    def forward(self, *args, **kwargs):
        args, kwargs = self._inputs(args, kwargs)
        gm, state = self._program(args, kwargs)
        return torch.func.functional_call(gm, state, args, kwargs, tie_weights=False)

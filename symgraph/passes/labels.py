"""Label tensors: integer tensors whose *values* are coordinates of an axis class.

A mixture-of-experts router picks, for every token, the ``k`` experts with the largest scores:
``top_k_index = topk(softmax(h Wᵣᵀ), k).indices``. Permuting the experts (the rows of ``Wᵣ``,
the first axis of every stacked expert weight) leaves the function unchanged, but it does not
move ``top_k_index`` along any of its axes: it *relabels its values*. So the analysis tracks,
besides axes, which tensors hold labels of which class (a :class:`~.registry.Label`):

- ``topk`` along a permutation class labels its indices with that class (:func:`topk`);
- a relayout (view, reshape, expand, clone, select, an integer cast...) moves values without
  changing them, so its output holds the same labels (:func:`flow`);
- indexing a tensor by labels of its own axis class (``gate_up_proj[expert_ids]``: every
  token gets its expert's weights) is invariant under the joint relabelling: the indexed axis
  joins the label class instead of being fixed (the ``index.Tensor`` rule reads
  ``ctx.label``);
- any other reader (arithmetic, comparisons, ``one_hot``, ``histc``, an output) reads the labels
  as numbers: the labelled class is fixed, with that reason.

A label class is a permutation class (labels can only be permuted). Hugging Face experts are
traced with their ``batched_mm`` implementation (:func:`symgraph.passes.trace.graph_friendly`), whose
graph is a gather by labels and batched matmuls; the ``grouped_mm`` one sorts tokens by expert
(an order that depends on the labels' values) and would fix the experts.
"""
from __future__ import annotations

import torch

from .nodes import packet
from .rules.reductions import nonlinear_others
from .registry import Label, Meet, NoFiber, Unify, dim, register

__all__ = ["RELAYOUT", "flow", "label_index", "topk"]

aten = torch.ops.aten

#: Ops that move values without changing them: their output holds the labels of their input.
RELAYOUT = {aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze,
            aten.clone, aten.expand, aten.permute, aten.transpose, aten.t, aten.flatten,
            aten.contiguous, aten.alias, aten.slice, aten.select, aten._to_copy, aten.detach,
            aten.lift_fresh_copy, aten.view_copy, aten.expand_copy, aten.squeeze_copy,
            aten.unsqueeze_copy, aten.permute_copy, aten.slice_copy, aten.select_copy}


def label_index(node, labels: dict):
    """``(k, index node)`` when ``node`` is ``x[..., idx, ...]`` with one index tensor ``idx``
    (at position ``k``) that holds labels, else None."""
    if node.target is not aten.index.Tensor:
        return None
    picked = [(k, i) for k, i in enumerate(node.args[1]) if i is not None]
    return picked[0] if len(picked) == 1 and picked[0][1] in labels else None


def _integer(node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex()


def flow(labels: dict, node) -> list:
    """Labels through ``node``: record the labels its output holds in ``labels`` and return the
    constraints for the labelled inputs it reads as numbers (their classes are fixed)."""
    ins = [i for i in node.all_input_nodes if i in labels]
    if not ins:
        return []
    p, src = packet(node.target), node.args[0] if node.args else None
    if p in RELAYOUT and src in labels and _integer(node):
        labels[node] = labels[src]
        ins.remove(src)
    picked = label_index(node, labels)  # one index tensor: the rule reads its labels
    if picked is not None and picked[1] in ins:
        ins.remove(picked[1])
    if p in (aten.scatter, aten.scatter_add, aten.gather) and len(node.args) > 2 and node.args[2] in ins:
        ins.remove(node.args[2])  # picked or written at labelled entries: their rules read them
    return [Meet(labels[i][0], "identity", f"{node.name}: reads the labels in {i.name} as numbers")
            for i in ins]


@register(aten.topk)
def topk(ctx):
    """``values, indices = topk(x, k, dim)``: picking the largest entries commutes with a
    permutation of ``dim`` (ties aside) and ``indices`` holds labels of that class; the ranked
    axis of both outputs is fixed; every other axis passes through, and only permutations
    commute with picking per slice."""
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(2, "dim", -1), len(xa))
    vals, idx = ctx.out
    cons = [Meet(xa[d], "perm", f"{ctx.where}: top-k ranks the entries along this axis"),
            Meet(vals[d], "identity", f"{ctx.where}: ranked entries"), Unify(vals[d], idx[d])]
    for o in (vals, idx):
        cons += [Unify(o[i], a) for i, a in enumerate(xa) if i != d]
    cons += nonlinear_others(ctx, xa, ctx.shape(x), {d}, "top-k")
    cons += [NoFiber(xa[i], xa[d]) for i in range(len(xa)) if i != d]
    return cons + [Label(1, xa[d], ctx.shape(x)[d])]

"""Refusals before alignment: non-finite weights, models of different structure, data
batches that do not match the traced inputs."""
from __future__ import annotations

import torch

from ..core.finite import all_finite
from ..errors import InputError, StructureMismatchError

__all__ = ["check_finite", "check_compatible", "batch_inputs", "by_shape"]


def check_finite(model, label):
    for name, p in model.named_parameters():
        if not p.is_meta and not all_finite(p.detach()):
            bad = int((~torch.isfinite(p)).sum())
            raise InputError(f"{label} has {bad} NaN/inf values in parameter {name!r}; "
                             "expected finite weights")


def check_compatible(ra, rb):
    """Same graph structure (sizes may differ on non-fixed classes); name the first difference."""
    ga, gb = ra.groups, rb.groups
    na = [(n, t) for n, op, t in ra.nodes() if op == "call_function"]
    nb = [(n, t) for n, op, t in rb.nodes() if op == "call_function"]
    for (xn, xt), (yn, yt) in zip(na, nb):
        if xt != yt:
            raise StructureMismatchError(
                f"the models' graphs differ at node {xn} ({xt}) vs {yn} ({yt}); "
                "expected two models of the same architecture (same ops in the same order)")
    if len(na) != len(nb):
        raise StructureMismatchError(
            f"the models' graphs differ in length ({len(na)} vs {len(nb)} ops); expected the same "
            "architecture and depth")
    pa, pb = ra.parameters, rb.parameters
    if pa != pb:
        diff = next((x, y) for x, y in zip(pa + [None], pb + [None]) if x != y)
        raise StructureMismatchError(f"parameter names differ: {diff[0]!r} vs {diff[1]!r}")
    if [f.to_dict() for f in ra.folds] != [f.to_dict() for f in rb.folds]:
        raise StructureMismatchError("the models fold different norms into their readers; "
                                     "expected the same architecture")
    gauge = {n for f in ra.folds for n in (f.gain, None if f.keep_shift else f.shift) if n}
    for name in pa:
        if name in gauge:  # a folded gain or shift: B's takes A's values (Alignment.gauge)
            continue
        axa, axb = ra.param_axes(name), rb.param_axes(name)
        for d, (a, b) in enumerate(zip(axa, axb)):
            x, y = ra.axis_size(a), rb.axis_size(b)
            if x != y and ra.axis_fixed(a):
                raise StructureMismatchError(
                    f"parameter {name!r} dim {d} has size {x} in model A and {y} in model B, and "
                    "that axis is fixed (e.g. vocabulary, labels, input features): expected equal "
                    "sizes (mismatched vocabularies?)")
    for x, y in zip(ga, gb):
        if x.kind == "rope" and tuple(x.pairs or ()) != tuple(y.pairs or ()):
            raise StructureMismatchError(
                f"symmetry group {x.id} ({x.module}) rotates {x.dim} rotary coordinates in A but {y.dim} "
                "in B (different head_dim or rotary fraction); expected the same attention head size")
    if len(ga) != len(gb) or any(x.kind != y.kind or bool(x.outer) != bool(y.outer) for x, y in zip(ga, gb)):
        for x, y in zip(ga, gb):
            if x.kind != y.kind:
                raise StructureMismatchError(
                    f"symmetry group {x.id} ({x.module}) is {x.kind} in A but {y.kind} in B")
        raise StructureMismatchError(f"the models have {len(ga)} and {len(gb)} symmetry groups")


def batch_inputs(report, batch, index, check_shapes: bool = True):
    """``(args, kwargs)`` for one data batch, checked against the traced inputs' shapes."""
    args, kwargs = report.inputs
    if isinstance(batch, dict):
        b_args, b_kwargs = (), {**{k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}, **batch}
    elif isinstance(batch, torch.Tensor):
        b_args, b_kwargs = (batch,), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    elif isinstance(batch, (tuple, list)):
        b_args, b_kwargs = tuple(batch), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    else:
        raise InputError(f"data batch {index} is a {type(batch).__name__}; expected the same form as "
                         "inputs (a tuple of tensors or a dict of keyword tensors)")
    ex = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    got = [t for t in list(b_args) + list(b_kwargs.values()) if isinstance(t, torch.Tensor)]
    if len(ex) != len(got):
        raise InputError(f"data batch {index} has {len(got)} tensors; expected {len(ex)} (the same form as "
                         "the inputs the models were traced with)")
    if check_shapes and any(tuple(x.shape) != tuple(y.shape) for x, y in zip(ex, got)):
        raise InputError(
            f"data batch {index} has tensor shapes {[tuple(t.shape) for t in got]}; expected "
            f"{[tuple(t.shape) for t in ex]} (the shapes the models were traced with: every batch "
            "must have the same shapes as the first)")
    if isinstance(batch, dict):
        # keep the traced keyword order
        b_kwargs = {k: b_kwargs[k] for k in kwargs} | {k: v for k, v in b_kwargs.items() if k not in kwargs}
    return b_args, b_kwargs


def _shapes(report, batch, index) -> tuple:
    args, kwargs = batch_inputs(report, batch, index, check_shapes=False)
    return tuple(tuple(t.shape) for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor))


def by_shape(reports, models, data) -> list:
    """The batches of ``data`` grouped by their tensor shapes: ``[(reports, [(index, batch)])]``,
    each group with reports of ``models`` traced on that shape (the given ``reports`` where the
    shapes are the traced ones). An exported graph has static shapes; other batch sizes and
    sequence lengths are traced again, and their groups must be the same."""
    from ..report.api import analyze
    args, kwargs = reports[0].inputs
    traced = tuple(tuple(t.shape) for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor))
    groups: dict = {}
    for i, batch in enumerate(data):
        groups.setdefault(_shapes(reports[0], batch, i), []).append((i, batch))
    out = []
    for shapes, items in groups.items():
        if shapes == traced:
            out.append((tuple(reports), items))
            continue
        if models is None:
            batch_inputs(reports[0], items[0][1], items[0][0])  # the shape refusal
        new = tuple(analyze(m, items[0][1], outputs=reports[0].outputs) for m in models)
        for r, n in zip(reports, new):
            if [(g.kind, g.dim, g.blocks) for g in r.groups] != [(g.kind, g.dim, g.blocks) for g in n.groups]:
                raise InputError(f"data batch {items[0][0]} (tensor shapes {list(shapes)}) gives the model "
                                 f"other symmetry groups than the traced shapes {list(traced)}; expected "
                                 "batches of the traced shapes")
        out.append((new, items))
    return out

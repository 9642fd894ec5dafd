"""Refusals before alignment: non-finite weights, models of different structure, data
batches that do not match the traced inputs; and before a saved alignment is applied: each
element checked against its group (:func:`check_element`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.elements import Map, Perm, is_perm
from ..core.groups import GroupKind
from ..core.finite import all_finite
from ..errors import InputError, NeedsMemory, StructureMismatchError

__all__ = ["check_finite", "check_compatible", "check_movable", "batch_inputs", "by_shape", "ElementGroup", "element_groups",
           "check_element", "check_element_shape", "element_tol", "COND_LIMIT"]


def check_finite(model, label, values: bool = False):
    """Refuse ``model`` (named ``label``) with a NaN/inf parameter, naming it; with ``values``
    (a user's model to merge or align) also one whose parameters are on ``meta``, without values."""
    for name, p in model.named_parameters():
        if values and p.is_meta:
            raise InputError(f"{label} has parameter {name!r} on the meta device (no values); expected a model "
                             "with its weights (loaded, or moved to a real device)")
        if not p.is_meta and not all_finite(p.detach()):
            bad = int((~torch.isfinite(p)).sum())
            raise InputError(f"{label} has {bad} NaN/inf values in parameter {name!r}; "
                             "expected finite weights")


def check_movable(report):
    """Refuse to align where ``report`` fixes every parameter because one is never read by the
    traced inputs (the report's ``unread``): the alignment
    would be the identity and a merge the plain average of unaligned models, the option asking
    for alignment silently ignored. :class:`~symgraph.errors.NeedsMemory`, so that a merge
    whose report was traced on ``meta`` tries again with the models loaded (real values may
    take the branch that reads it); a loaded model's refusal is the same line."""
    if getattr(report, "unread", None):
        raise NeedsMemory(f"nothing can be aligned: every parameter stays fixed ({report.unread}); expected "
                          "data that reads it, or no alignment (align 'none') to average the models as they are")


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
    b_args: tuple
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


# ---------------------------------------------------------------------------------------------
# A saved alignment's elements, checked against their groups before they are applied
# ---------------------------------------------------------------------------------------------

COND_LIMIT = 1e9  # a gl element's largest condition number (fit_gl keeps its maps below 1e8)
_ORTHOGONAL_KINDS = ("perm", "signed_perm", "orthogonal", "orthogonal_mean", "identity")
_KINDS = _ORTHOGONAL_KINDS + ("scaled_perm", "rope", "gl")


@dataclass(frozen=True)
class ElementGroup:
    """What an element of one group must look like: the group's ``kind``, ``dim`` (the side of
    one block's matrix), ``blocks`` (how many blocks: the product of the fibre sizes) and,
    where known, ``stack`` (the sizes of the classes it is fibred over, the element's leading
    dims); ``dim_a`` / ``stack_a``: the same in model A (a map's rows), where A differs."""
    id: int
    kind: GroupKind
    dim: int
    blocks: int
    stack: tuple | None = None
    dim_a: int | None = None
    stack_a: tuple | None = None

    @property
    def size(self) -> int:
        return self.dim * self.blocks

    def describe(self) -> str:
        rows = self.dim_a if self.dim_a is not None else self.dim
        per = f"{rows}x{self.dim}" + (f" per block, {self.blocks} blocks" if self.blocks > 1 else "")
        return f"group {self.id} ({self.kind}, {per})"


def element_groups(report_b, report_a=None) -> dict:
    """``{group id: ElementGroup}`` of ``report_b``'s groups (and A's sizes from ``report_a``)."""
    ga = {g.id: g for g in (report_a.groups if report_a is not None else ())}
    out = {}
    for g in report_b.groups:
        a = ga.get(g.id)
        out[g.id] = ElementGroup(g.id, g.kind, g.dim, g.blocks, tuple(report_b.fibre_shape(g.id)),
                                 a.dim if a is not None else None,
                                 tuple(report_a.fibre_shape(g.id)) if a is not None else None)
    return out


def element_tol(dtype, n: int) -> float:
    """How far (max abs entry) a stored map of ``dtype`` and side ``n`` may be from its group:
    a few hundred rounding errors of an ``n``-term sum, and never below float32's (a map solved
    in float32 and stored in float64 keeps float32's accuracy)."""
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    return 256.0 * eps * math.sqrt(max(n, 1))


class _Bad(Exception):
    """One thing wrong with an element: what was found, and what was expected."""

    def __init__(self, found: str, expected: str):
        super().__init__(found)
        self.found, self.expected = found, expected


def check_element(el, group: ElementGroup, *, stored: str | None = None, where: str = "the alignment"):
    """Refuse (:class:`InputError`, one line naming ``where``, the group, what was found and
    what was expected) an element that is not in ``group``: a :class:`Perm` whose index vector
    is not a permutation of the group's size; a ``[*fibre, n, n]`` tensor (``stored``: the kind
    it was saved as, ``"perm-matrix"`` or ``"orthogonal"`` promising that its inverse-transpose
    is itself) that is not finite, not of the group's shape, or not in the group's kind
    (orthogonal for perm / signed_perm / orthogonal / orthogonal_mean, a positively scaled
    permutation for scaled_perm, a rotation up to positive scales for rope, invertible and
    well conditioned for gl); a :class:`Map` whose ``co`` is not ``[*fibre, n_A, n_B]``, or
    whose ``contra`` is neither ``co``'s inverse-transpose (a group element) nor the
    column-normalised plan of ``co``'s row-normalised one (a transport plan)."""
    try:
        if group.kind not in _KINDS:
            raise _Bad(f"an unknown kind {group.kind!r}", f"one of {', '.join(_KINDS)}")
        if isinstance(el, Perm):
            _check_index(el.index, group)
        elif isinstance(el, Map):
            _check_map(el, group)
        elif torch.is_tensor(el):
            _check_dense(el, group, stored)
        else:
            raise _Bad(f"a {type(el).__name__}", "an index vector, a matrix or a map")
    except _Bad as e:
        raise InputError(f"{where}: the element of {group.describe()} is {e.found}; expected {e.expected}") from None


def check_element_shape(shape, group: ElementGroup, *, stored: str, where: str = "the alignment"):
    """:func:`check_element`'s shape refusal from a stored shape alone (before the tensor is
    read): ``stored`` is the saved kind ("perm": an index vector; "map": co/contra; else a
    matrix per block)."""
    t = torch.empty(tuple(int(x) for x in shape), device="meta")
    try:
        if stored == "perm":
            if t.dim() != 1 or t.shape[0] != group.size:
                raise _Bad(f"an index vector of shape {list(t.shape)}",
                           f"{group.size} indices (a permutation of 0..{group.size - 1})")
        else:
            rows = group.dim_a if stored == "map" and group.dim_a is not None else group.dim
            _check_shape(t, group, rows, "a map whose co" if stored == "map" else "a matrix")
    except _Bad as e:
        raise InputError(f"{where}: the element of {group.describe()} is {e.found}; expected {e.expected}") from None


def _check_index(index, g: ElementGroup):
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise _Bad(f"an index vector of dtype {str(index.dtype).removeprefix('torch.')}",
                   "an integer index vector (int64)")
    n = g.size
    if g.blocks != 1:
        raise _Bad("an index vector", f"a [{', '.join(map(str, (*(g.stack or (g.blocks,)), g.dim, g.dim)))}] "
                   "tensor (one matrix per block)")
    if g.kind in ("rope", "identity"):
        raise _Bad("a permutation", f"an element of a {g.kind} group (permutations are not in it)")
    if g.dim_a is not None and g.dim_a != g.dim:
        raise _Bad("a permutation", f"a [{g.dim_a}, {g.dim}] map between the models' widths")
    if index.dim() != 1 or index.shape[0] != n:
        raise _Bad(f"an index vector of shape {list(index.shape)}", f"{n} indices (a permutation of 0..{n - 1})")
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= n:
        raise _Bad(f"an index vector holding {lo if lo < 0 else hi}, out of range 0..{n - 1}",
                   f"a permutation of 0..{n - 1}")
    counts = torch.bincount(index.long(), minlength=n)
    if bool((counts != 1).any()):
        dup = int(torch.nonzero(counts > 1)[0])
        raise _Bad(f"an index vector in which index {dup} appears {int(counts[dup])} times (and "
                   f"{int((counts == 0).sum())} indices never)", f"a permutation of 0..{n - 1}: each index once")


def _shape_of(g: ElementGroup, a_side: bool = False) -> list | None:
    fib = g.stack_a if a_side and g.stack_a is not None else g.stack
    return None if fib is None else [*fib]


def _check_float(t, what: str):
    if not t.is_floating_point():
        raise _Bad(f"{what} of dtype {str(t.dtype).removeprefix('torch.')}", "a floating-point tensor")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise _Bad(f"{what} holding {bad} NaN/inf values", "finite values")


def _check_shape(t, g: ElementGroup, rows: int, what: str):
    lead = list(t.shape[:-2])
    fib = _shape_of(g, rows != g.dim)
    want_lead = fib if fib is not None else None
    ok = t.dim() >= 2 and t.shape[-1] == g.dim and t.shape[-2] == rows and (
        lead == want_lead if want_lead is not None else math.prod(lead) == g.blocks)
    if not ok:
        want = (want_lead if want_lead is not None else ([g.blocks] if g.blocks > 1 else [])) + [rows, g.dim]
        raise _Bad(f"{what} of shape {list(t.shape)}", f"shape {want}")


def _orth_dev(M):
    eye = torch.eye(M.shape[-1], dtype=M.dtype)
    return float((M @ M.mT - eye).abs().max()) if M.numel() else 0.0


def _check_dense(E, g: ElementGroup, stored):
    _check_float(E, "a matrix")
    _check_shape(E, g, g.dim, "a matrix")
    M, n = E.detach().to("cpu", torch.float64), g.dim
    tol = element_tol(E.dtype, n)
    if stored == "perm-matrix" and not is_perm(M):
        raise _Bad("a matrix saved as a permutation matrix that is not one", "0/1 entries, one 1 per row and column")
    if stored == "orthogonal" and (dev := _orth_dev(M)) > tol:
        raise _Bad(f"a matrix saved as orthogonal that is {dev:.2g} from it (max |E Eᵀ - I|)",
                   f"an orthogonal matrix (within {tol:.1g} for {str(E.dtype).removeprefix('torch.')})")
    _check_kind(M, g, tol)


def _check_kind(M, g: ElementGroup, tol: float):
    n, kind = M.shape[-1], g.kind
    if kind in ("perm", "identity"):
        P = M.round()
        if float((M - P).abs().max()) > tol or not is_perm(P) or (
                kind == "identity" and float((M - torch.eye(n, dtype=M.dtype)).abs().max()) > tol):
            raise _Bad("not a permutation matrix" if kind == "perm" else "not the identity",
                       "0/1 entries, one 1 per row and column" if kind == "perm" else "the identity")
        return
    if kind == "signed_perm":
        P = M.abs().round()
        if float((M.abs() - P).abs().max()) > tol or not is_perm(P):
            raise _Bad("not a signed permutation matrix", "entries 0 or ±1, one nonzero per row and column")
        return
    if kind == "scaled_perm":
        nz = M != 0
        if not (bool((nz.sum(-1) == 1).all()) and bool((nz.sum(-2) == 1).all()) and bool((M[nz] > 0).all())):
            raise _Bad("not a positively scaled permutation matrix",
                       "one positive entry per row and column (diag(s)·P, s > 0)")
        s = M[nz]
        if float(s.max() / s.min()) > COND_LIMIT:
            raise _Bad(f"a scaled permutation with scales {float(s.min()):.3g}..{float(s.max()):.3g}",
                       f"scales within a factor {COND_LIMIT:.0e} of each other")
        return
    if kind in ("orthogonal", "orthogonal_mean"):
        dev = _orth_dev(M)
        if dev > tol:
            raise _Bad(f"not orthogonal: max |E Eᵀ - I| = {dev:.2g}", f"an orthogonal matrix (within {tol:.1g})")
        if kind == "orthogonal_mean":
            ones = torch.ones(n, dtype=M.dtype)
            dev = float((M @ ones - ones).abs().max())
            if dev > tol * math.sqrt(n):
                raise _Bad(f"an orthogonal matrix that moves the all-ones vector by {dev:.2g}",
                           "an orthogonal matrix fixing the all-ones vector (a mean-preserving rotation)")
        return
    if kind == "rope":  # a rotation per RoPE pair, scaled per pair where the full group was fitted
        G = M @ M.mT
        d = torch.diagonal(G, dim1=-2, dim2=-1)
        off = float((G - torch.diag_embed(d)).abs().max() / d.abs().max().clamp_min(1e-300))
        if not bool((d > 0).all()):
            raise _Bad("not a (scaled) rotation: a row is zero (the block is singular)",
                       "a rotation of the RoPE pairs, every row nonzero")
        if off > tol:
            raise _Bad(f"not a (scaled) rotation: its rows are not orthogonal (off-diagonal of E Eᵀ "
                       f"{off:.2g} of its diagonal)", f"a rotation of the RoPE pairs (within {tol:.1g})")
        if float((d.max() / d.min()).sqrt()) > COND_LIMIT:
            raise _Bad("a rotation scaled by factors too far apart", f"a condition number below {COND_LIMIT:.0e}")
        return
    # gl: invertible and well conditioned
    if _orth_dev(M) <= tol:
        return
    sv = torch.linalg.svdvals(M)
    cond = float((sv[..., 0] / sv[..., -1].clamp_min(1e-300)).max())
    if not cond <= COND_LIMIT:
        raise _Bad(f"singular or ill conditioned (condition number {cond:.3g})",
                   f"an invertible matrix with condition number below {COND_LIMIT:.0e}")


def _check_map(m: Map, g: ElementGroup):
    co, contra = m.co, m.contra
    if not torch.is_tensor(co) or not torch.is_tensor(contra):
        raise _Bad("a map without co/contra tensors", "co and contra tensors")
    _check_float(co, "a map whose co")
    _check_float(contra, "a map whose contra")
    rows = g.dim_a if g.dim_a is not None else co.shape[-2] if co.dim() >= 2 else g.dim
    _check_shape(co, g, rows, "a map whose co")
    if tuple(contra.shape) != tuple(co.shape):
        raise _Bad(f"a map whose contra has shape {list(contra.shape)} and co {list(co.shape)}",
                   "co and contra of one shape")
    C, K = co.detach().to("cpu", torch.float64), contra.detach().to("cpu", torch.float64)
    tol = element_tol(co.dtype, max(co.shape[-2:]))
    if bool((C >= 0).all()) and bool((K >= 0).all()) and bool(((C != 0) == (K != 0)).all()):
        rs, cs = C.sum(-1), K.sum(-2)
        if bool((((rs - 1).abs() <= tol) | (rs == 0)).all()) and bool((((cs - 1).abs() <= tol) | (cs == 0)).all()):
            return  # a transport plan: co averages B's units into A's, contra sums them
    if C.shape[-1] == C.shape[-2]:
        eye = torch.eye(C.shape[-1], dtype=C.dtype)
        dev = float((C.mT @ K - eye).abs().max())
        if dev <= tol * 16:
            sv = torch.linalg.svdvals(C)
            cond = float((sv[..., 0] / sv[..., -1].clamp_min(1e-300)).max())
            if not cond <= COND_LIMIT:
                raise _Bad(f"a map whose co is ill conditioned (condition number {cond:.3g})",
                           f"a condition number below {COND_LIMIT:.0e}")
            _check_kind(C, g, tol)
            return
    raise _Bad("a map whose contra is neither co's inverse-transpose nor its transport plan's column-normalised "
               "form", "contra = co⁻ᵀ (a group element) or co, contra the row- and column-normalised "
               "forms of one nonnegative plan")

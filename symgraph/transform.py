"""Applying group elements to parameters.

An element of a leaf class is a tensor ``[*fibre_sizes, n, n]``: one ``n×n`` matrix per entry
of the outer (head) classes it is fibred over. For a parameter axis we build the full matrix of
the axis from its structure: a sum is block-diagonal; a product applies each factor's element
along its factor axis, innermost first (fibred elements are indexed by their outer factor's
*source* index), which is ``perm(heads) ≀ G(head_dim)``.
"""
from __future__ import annotations

import copy
import string

import torch

from .errors import InputError


def _inv_t(E):
    if _is_perm(E):
        return E  # P^{-T} = P
    eye = torch.eye(E.shape[-1], dtype=E.dtype)
    if E.shape[-1] == E.shape[-2] and bool(((E @ E.mT) - eye).abs().max() <= 1e-12):
        return E  # orthogonal (Procrustes, RoPE): R^{-T} = R
    return torch.linalg.inv(E).mT


def _is_perm(M):
    """A (batch of) permutation matrices: exactly one nonzero per row, rows and columns sum
    to 1 (so that nonzero is 1 and no column is hit twice). Three reductions, no copies."""
    if getattr(M, "_symgraph_perm", False):
        return True
    n = M.shape[-1]
    return (M.shape[-2] == n and int(M.count_nonzero()) == M.numel() // n
            and bool((M.sum(-1) == 1).all()) and bool((M.sum(-2) == 1).all()))


class Perm:
    """A permutation element kept as indices (``n`` integers instead of an ``n×n`` matrix):
    row ``i`` of the matrix has its 1 in column ``index[i]``. Used by :func:`symgraph.align`
    for unfibred permutation classes; :func:`axis_matrix` returns the index vector for them."""

    def __init__(self, index):
        self.index = torch.as_tensor(index, dtype=torch.long)

    @classmethod
    def from_matrix(cls, M):
        return cls(M.argmax(-1))

    @property
    def shape(self):
        n = len(self.index)
        return torch.Size((n, n))

    def dense(self, dtype=torch.float64):
        n = len(self.index)
        M = torch.zeros(n, n, dtype=dtype)
        M[torch.arange(n), self.index] = 1
        M._symgraph_perm = True
        return M


class Map:
    """A (possibly rectangular) map between two models' coordinates of one class.

    ``co [*fibres, n_A, n_B]`` acts on covariant slots, ``contra`` on contravariant ones. For a
    group element ``g``: ``co = g``, ``contra = g^{-T}``. For a transport plan ``T``: ``co``
    averages B's units into each of A's (row-normalised T), ``contra`` sums their contributions
    (column-normalised T), so that a function-preserving widening is undone exactly.
    """

    def __init__(self, co, contra):
        self.co, self.contra = co, contra

    @classmethod
    def from_plan(cls, T):
        co = T / T.sum(-1, keepdim=True).clamp_min(1e-300)
        contra = T / T.sum(-2, keepdim=True).clamp_min(1e-300)
        return cls(co, contra)

    @property
    def shape(self):
        return self.co.shape


def axis_matrix(an, axis: int, elements: dict, parity: int = 0):
    """Full ``n_A×n_B`` matrix acting on ``axis`` (float64), or None when it is the identity.

    For an unstructured axis whose element is a :class:`Perm`, the 1-D index vector instead
    (``P^{-T} = P``, so parity does not matter); :func:`apply_along` takes either."""
    r, _ = an.uf.find(axis)
    if r not in an.uf.struct and isinstance(elements.get(r), Perm):
        return elements[r].index
    E, fib = _node(an, axis, parity, elements)
    if fib:
        raise AssertionError("parameter axis with an unresolved fibre")  # analysis guarantees
    return E


def _leaf(an, r, p, elements):
    E = elements.get(r)
    if E is None:
        return None, ()
    if isinstance(E, Perm):
        E = E.dense()
    elif isinstance(E, Map):
        E = E.contra if p else E.co
    elif p:
        E = _inv_t(E)
    return E, an.fibre.get(r, ())


def _factors(an, axis, par):
    """Flatten nested products: list of (axis, parity) factors."""
    r, p = an.uf.find(axis)
    p ^= par
    s = an.uf.struct.get(r)
    if s is not None and s[0] == "prod":
        out = []
        for a, pa in s[1]:
            out += _factors(an, a, pa ^ p)
        return out
    return [(axis, par)]


def _node(an, axis, par, elements):
    uf = an.uf
    r, p = uf.find(axis)
    p ^= par
    s = uf.struct.get(r)
    if s is None:
        return _leaf(an, r, p, elements)
    kind, parts = s
    if kind == "sum":
        subs = [(_node(an, a, pa ^ p, elements), uf.size[uf.find(a)[0]]) for a, pa in parts]
        if all(E is None for (E, _), _ in subs):
            return None, ()
        fibres = []
        for (E, f), _ in subs:
            fibres += [x for x in f if x not in fibres]
        blocks = []
        for (E, f), m in subs:
            E = torch.eye(m, dtype=torch.float64) if E is None else E
            blocks.append(_broadcast_fibres(E, f, fibres, uf))
        na, nb = sum(b.shape[-2] for b in blocks), sum(b.shape[-1] for b in blocks)
        out = torch.zeros(*[uf.size[x] for x in fibres], na, nb, dtype=torch.float64)
        oa = ob = 0
        for b in blocks:
            out[..., oa:oa + b.shape[-2], ob:ob + b.shape[-1]] = b
            oa, ob = oa + b.shape[-2], ob + b.shape[-1]
        return out, tuple(fibres)
    # product
    n = uf.size[r]
    factors = _factors(an, axis, par)
    fclasses = [uf.find(a)[0] for a, _ in factors]
    fsizes = [uf.size[c] for c in fclasses]
    subs = []
    for a, pa in factors:
        ra, pra = uf.find(a)
        if ra in uf.struct:  # a sum inside a product
            subs.append(_node(an, a, pa, elements))
        else:
            subs.append(_leaf(an, ra, pra ^ pa, elements))
    if all(E is None for E, _ in subs):
        return None, ()
    outer = []
    for _, f in subs:
        outer += [x for x in f if x not in fclasses and x not in outer]
    letters = iter(string.ascii_letters)
    o_l = [next(letters) for _ in outer]
    f_l = [next(letters) for _ in factors]
    col = next(letters)
    osz = [uf.size[x] for x in outer]
    X = torch.eye(n, dtype=torch.float64).reshape(*fsizes, n)
    X = X.expand(*osz, *fsizes, n).clone() if osz else X
    for k in _application_order(subs, fclasses):
        E, f = subs[k]
        if E is None:
            continue
        sub_l = [f_l[fclasses.index(x)] if x in fclasses else o_l[outer.index(x)] for x in f]
        new = next(letters)
        x_sub = o_l + f_l + [col]
        out_sub = o_l + [new if i == k else c for i, c in enumerate(f_l)] + [col]
        X = torch.einsum(f"{''.join(sub_l)}{new}{f_l[k]},{''.join(x_sub)}->{''.join(out_sub)}",
                         E, X)
    return X.reshape(*osz, -1, n), tuple(outer)


def _application_order(subs, fclasses):
    """Innermost factor first, but a factor fibred over another factor of the same product
    always acts before it: fibred elements are indexed by the *source* index of their outer
    factor, whichever order the factors have in this flatten (``(H, d)`` or ``(d, H)``)."""
    needs = [{fclasses.index(x) for x in f if x in fclasses} for _, f in subs]
    left, order = list(range(len(subs))), []
    while left:
        ready = [k for k in left if not any(k in needs[m] for m in left if m != k)]
        k = max(ready) if ready else max(left)
        order.append(k)
        left.remove(k)
    return order


def _broadcast_fibres(E, have, want, uf):
    """Expand ``E [*have, a, b]`` to ``[*want, a, b]`` (``have`` ⊆ ``want``)."""
    if list(have) == list(want):
        return E
    perm = [list(have).index(x) for x in want if x in have]
    if have:
        E = E.permute(*perm, len(have), len(have) + 1)
    shape = [uf.size[x] if x in have else 1 for x in want]
    E = E.reshape(*shape, *E.shape[-2:])
    return E.expand(*[uf.size[x] for x in want], *E.shape[-2:])


def apply_along(t: torch.Tensor, d: int, M) -> torch.Tensor:
    """``t`` with ``M`` applied along dim ``d``: ``t'[.., i, ..] = Σ_j M[i, j] t[.., j, ..]``.

    ``M`` may also be a 1-D index tensor: the permutation ``t'[.., i, ..] = t[.., M[i], ..]``.
    """
    moved = t.movedim(d, 0)
    shape = moved.shape
    if M.dim() == 1:
        return moved[M].movedim(0, d)
    if _is_perm(M):
        return moved[M.argmax(1)].movedim(0, d)  # a permutation: gather, no matmul
    out = (M.to(t.dtype) @ moved.reshape(shape[0], -1)).reshape(M.shape[0], *shape[1:])
    return out.movedim(0, d)


def transformed_state(report, transform, model) -> dict:
    """New values of every parameter the transform moves: ``{fqn: tensor}``."""
    an = report._analysis
    out = {}
    for name, node in an.param_nodes.items():
        axes = an.node_axes[node]
        try:
            p = model.get_parameter(name)
        except AttributeError as e:
            raise InputError(f"model has no parameter {name!r} that its report names; "
                             "transform the model the report was computed from") from e
        if p.is_meta:
            raise InputError(f"parameter {name!r} is on the meta device: no weights to transform")
        if tuple(p.shape) != tuple(an.uf.size[a] for a in axes):  # noqa: SIM102
            raise InputError(f"parameter {name!r} has shape {tuple(p.shape)}, the report expects "
                             f"{tuple(an.uf.size[a] for a in axes)}")
        val = None
        for d, a in enumerate(axes):
            M = axis_matrix(an, a, transform.elements)
            if M is None:
                continue
            base = p.detach() if val is None else val
            val = apply_along(base.double() if base.dtype != torch.float64 else base, d, M)
        if val is not None:
            out[name] = val.to(p.dtype)
    return out


def transform(model, t):
    """Return a transformed copy of ``model``; ``model`` itself is never modified."""
    new = copy.deepcopy(model)
    state = transformed_state(t.report, t, model)
    with torch.no_grad():
        for name, val in state.items():
            new.get_parameter(name).copy_(val)
    return new

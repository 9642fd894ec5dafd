"""The solvers behind :mod:`symgraph.solve`: Hungarian (dense, sparse or by row maxima),
signed Hungarian, Procrustes (plain, mean-preserving, RoPE pairs), optimal transport, blocks
per head and nested heads, each returning a :class:`SolveResult`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ..core.elements import Perm, mark_orth, mark_perm
from ..core.finite import all_finite
from ..core.groups import GroupKind
from ..errors import InputError
from . import turns
from ._auction import auction
from ._polar import DEVICE_BATCH_MAX, decompose, polar, polar_from_svd  # noqa: F401 (re-exported)

__all__ = ['SolveResult', 'hungarian', 'signed_hungarian', 'procrustes', 'procrustes_mean', 'rope_procrustes', 'optimal_transport', 'inner_blocks', 'nested_heads', 'solve', 'SOLVERS', 'ROW_MAXIMA']

SOLVERS = ("hungarian", "procrustes", "rope", "ot", "sinkhorn")
ROW_MAXIMA = True  # skip the assignment when the row maxima already form a permutation
#: On an accelerator: assignments by the auction on the device (:mod:`._auction`), Procrustes
#: by the Newton–Schulz polar factor (:mod:`._polar`); CPU tensors keep SciPy and the SVD.
ON_DEVICE = True
#: The smallest square side the device auction takes: each of its rounds (about 2n of them)
#: is a dozen kernel launches and a host sync, which below this side cost more than SciPy's
#: solve plus the similarity's copy to the host (an estimate from the rounds counted by
#: benchmarks/bench_solvers.py; to be calibrated on a GPU).
AUCTION_MIN = 2048


def _on_device(x) -> bool:
    return ON_DEVICE and isinstance(x, torch.Tensor) and x.device.type != "cpu"


@dataclass
class SolveResult:
    """A solved element or map.

    element : float64 tensor ``[n_A, n_B]`` (or ``[*blocks, n_A, n_B]``).
    objective : the attained ``<element, S>`` (summed over blocks).
    status : "optimal", "soft" (transport map), or a message.
    seconds : time in the assignment/SVD/OT call itself.
    """
    element: torch.Tensor | Perm  # a Perm only from hungarian(dense=False)
    objective: float
    status: str = "optimal"
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _np(S):
    return S.detach().double().cpu().numpy() if isinstance(S, torch.Tensor) else np.asarray(S, float)


#: Square assignments from this size on are solved on sparse candidate sets first.
SPARSE_N = 4096
#: Candidates per row and per column of a sparse assignment.
SPARSE_K = 64


def _candidates(t, k: int):
    """Each row's and each column's ``k`` largest entries of the square ``t``, on ``t``'s
    device: ``(rows, cols, values)`` as NumPy arrays (int64, int64, float64), each edge once,
    in row-major order. Only these ``O(n·k)`` values leave the device."""
    n = t.shape[0]
    rv, ri = torch.topk(t, k, dim=1)  # [n, k]: row i's best columns
    cv, ci = torch.topk(t, k, dim=0)  # [k, n]: column j's best rows (no transposed copy of t)
    ar = torch.arange(n, device=t.device)
    keys = torch.cat([(ar[:, None] * n + ri).reshape(-1), (ci * n + ar).reshape(-1)])
    vals = torch.cat([rv.reshape(-1), cv.reshape(-1)])
    keys, order = torch.sort(keys)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    idx, val = keys[first].cpu().numpy(), vals[order][first].double().cpu().numpy()
    return idx // n, idx % n, val


def _sparse_assignment(t):
    """The best permutation among each row's and each column's ``SPARSE_K`` largest entries
    of ``t`` (SciPy's ``min_weight_full_bipartite_matching``, LAPJVsp): ``(rows, cols,
    status)``, or ``(None,) * 3`` when those candidates hold no full matching (the caller solves
    densely). The candidates are chosen on ``t``'s device and only their values are taken, in
    float64, to the CPU. Within :func:`.turns.in_turn` the solve runs in a worker process."""
    from scipy.sparse import coo_matrix
    n, k = t.shape[0], min(SPARSE_K, t.shape[0])
    rows, cols, vals = _candidates(t, k)
    w = (vals.max() - vals) + 1.0  # positive costs (an explicit zero would drop the edge)
    try:
        rr, cc = turns.lapjvsp(coo_matrix((w, (rows, cols)), shape=(n, n)).tocsr())
    except ValueError:
        return None, None, None
    order = np.argsort(rr)
    return rr[order], cc[order], f"optimal among top-{k} candidates"


def hungarian(S, dense: bool = True) -> SolveResult:
    """Permutation maximising ``Σ_i S[i, π(i)]`` (Jonker–Volgenant via SciPy).

    The element is the permutation matrix, or with ``dense=False`` (square ``S``) a
    :class:`~symgraph.core.elements.Perm` of ``n`` indices (no ``n×n`` matrix is built).

    >>> r = hungarian(torch.tensor([[0., 1.], [1., 0.]]))
    >>> r.element.tolist(), r.objective
    ([[0.0, 1.0], [1.0, 0.0]], 2.0)
    """
    # in its own float dtype, where it lies: the row maxima and a sparse solve's candidates
    # are taken there, and S comes to the CPU whole only for a dense solve
    t = torch.as_tensor(S).detach()
    t = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float64)
    t0, w0 = time.perf_counter(), turns.waited()
    square = t.shape[0] == t.shape[1]
    am = t.argmax(1)
    rows: np.ndarray | None
    cols: np.ndarray | None
    status: str | None
    if ROW_MAXIMA and square and int(torch.unique(am).numel()) == t.shape[0]:
        # every row's best column is distinct: Σ_i max_j S_ij is attained, so this permutation
        # is optimal without running the assignment (models already nearly aligned)
        rows, cols, status = np.arange(t.shape[0]), am.cpu().numpy(), "optimal (row maxima)"
    else:
        rows, cols, status = _sparse_assignment(t) if square and t.shape[0] >= SPARSE_N else (None,) * 3
        if rows is None and _on_device(t) and min(t.shape) >= AUCTION_MIN:
            found = auction(t)  # None: its certificate failed, SciPy decides
            if found is not None:
                rows, cols = (x.cpu().numpy() for x in found[:2])
                status = "optimal (device auction)"
        if rows is None:
            # (SciPy releases the GIL while it solves: other units run meanwhile in a turn)
            rows, cols = turns.outside(linear_sum_assignment, _np(t), maximize=True)
            status = "optimal"
    assert rows is not None and cols is not None and status is not None  # every branch above solved
    dt = time.perf_counter() - t0 - (turns.waited() - w0)  # not the time other units held the baton
    ri, ci = (torch.as_tensor(x, device=t.device) for x in (rows, cols))
    obj = float(t[ri, ci].double().sum())
    if not dense and square:
        return SolveResult(Perm(ci.long()), obj, status=status, seconds=dt)
    P = torch.zeros(t.shape, dtype=torch.float64)
    P[rows, cols] = 1.0
    P = P.to(S.device) if isinstance(S, torch.Tensor) else P  # back to the similarity's device
    if square:
        P = mark_perm(P)  # a hint for is_perm (skips re-checking)
    return SolveResult(P, obj, status=status, seconds=dt)


def signed_hungarian(S) -> SolveResult:
    """Signed permutation maximising ``Σ_i s_i S[i, π(i)]`` over permutations ``π`` and signs
    ``s_i = ±1`` (an odd activation's units: ``tanh(−x) = −tanh(x)``, so a unit may flip its
    input and output signs): the assignment of ``|S|``, each pair signed as its entry. A dense
    matrix with ``±1`` entries (orthogonal)."""
    s = torch.as_tensor(S, dtype=torch.float64)
    res = hungarian(s.abs(), dense=True)
    assert isinstance(res.element, torch.Tensor)  # dense=True: a matrix
    P = res.element * torch.sign(s).where(s != 0, torch.ones_like(s))
    return SolveResult(P, res.objective, status=res.status, seconds=res.seconds)


def _float(S):
    """``S`` as a float tensor for a factorisation: float32 stays float32 (the similarity of
    16-bit weights: an SVD in float32 is as exact as its input), anything else becomes
    float64."""
    s = torch.as_tensor(S)
    return s if s.dtype in (torch.float32, torch.float64) else s.to(torch.float64)


def procrustes(S, rescale: bool = False) -> SolveResult:
    """Orthogonal ``R = U Vᵀ`` maximising ``<R, S>`` where ``S = U Σ Vᵀ`` (where ``S`` is rank-deficient,
    the maximiser closest to the identity: :func:`~._polar.polar_from_svd`).

    With ``rescale`` (Zhang et al. 2024) the element is ``c·R``; ``c`` is returned in ``extra`` and is not
    applied (scalar rescaling is a merge-time weighting, not a symmetry of the model).
    """
    s = _float(S)
    t = time.perf_counter()
    extra: dict = {}
    if _on_device(s):  # matmuls at the device's rate; the SVD only where the iteration fails
        R, extra["polar"] = polar(s)
        obj = torch.sum(R * s, dtype=torch.float64)
    else:
        U, sig, Vh = decompose(torch.linalg.svd, s, full_matrices=False)
        R = polar_from_svd(U, sig, Vh)  # what S leaves free: B's order
        obj = sig.sum()
    dt = time.perf_counter() - t
    if rescale:
        extra["scale"] = float(obj / max(torch.trace(s @ s.mT).sqrt().item(), 1e-30))
    R = mark_orth(R)  # a hint for elements.inv_t (R^{-T} = R without an n^3 check)
    return SolveResult(R, float(obj), seconds=dt, extra=extra)


def procrustes_mean(S) -> SolveResult:
    """Orthogonal ``R`` with ``R𝟙 = 𝟙`` maximising ``<R, S>`` (the group of a LayerNorm
    stream): ``R = H diag(1, U Vᵀ) Hᵀ`` where ``H`` is an orthogonal basis whose first column is
    ``𝟙/√n`` and ``U Σ Vᵀ`` is the SVD of the mean-free block of ``Hᵀ S H``."""
    from ..core.groups import ones_basis
    s = torch.as_tensor(S, dtype=torch.float64)
    n = s.shape[-1]
    t = time.perf_counter()
    H = ones_basis(n, device=s.device)
    T = H.mT @ s @ H
    inner = torch.eye(n, dtype=torch.float64, device=s.device).expand_as(s).clone()
    obj = T[..., 0, 0]
    if n > 1:
        if _on_device(s):
            Q, _ = polar(T[..., 1:, 1:])
            inner[..., 1:, 1:] = Q
            obj = obj + (Q * T[..., 1:, 1:]).sum((-1, -2))
        else:
            U, sig, Vh = decompose(torch.linalg.svd, T[..., 1:, 1:], full_matrices=False)
            inner[..., 1:, 1:] = U @ Vh
            obj = obj + sig.sum(-1)
    R = H @ inner @ H.mT
    R = mark_orth(R)
    return SolveResult(R, float(obj.sum()), seconds=time.perf_counter() - t)


def rope_procrustes(S, pairs) -> SolveResult:
    """Block rotation on the given coordinate pairs maximising ``<R, S>``."""
    s = torch.as_tensor(S, dtype=torch.float64)
    n = s.shape[-1]
    R = torch.eye(n, dtype=torch.float64, device=s.device).expand_as(s).clone()
    obj = 0.0
    t = time.perf_counter()
    if _on_device(s) and len(pairs):  # every pair at once: no host round trip per pair
        i, j = (torch.as_tensor(x).to(s.device) for x in zip(*pairs))  # (not as_tensor(device=): PrivateUse1 fails)
        a = s[..., i, i] + s[..., j, j]
        b = s[..., j, i] - s[..., i, j]
        th = torch.atan2(b, a)
        c, sn = torch.cos(th), torch.sin(th)
        R[..., i, i], R[..., i, j], R[..., j, i], R[..., j, j] = c, -sn, sn, c
        pairs, obj = (), float(torch.sqrt(a * a + b * b).sum())
    for i, j in pairs:
        a = s[..., i, i] + s[..., j, j]
        b = s[..., j, i] - s[..., i, j]
        th = torch.atan2(b, a)
        c, sn = torch.cos(th), torch.sin(th)
        R[..., i, i], R[..., i, j], R[..., j, i], R[..., j, j] = c, -sn, sn, c
        obj += float(torch.sqrt(a * a + b * b).sum())
    R = mark_orth(R)
    return SolveResult(R, obj, seconds=time.perf_counter() - t)


def _marginal(m, n):
    """Unit masses as a distribution: uniform where ``m`` is None, else ``m`` normalised, with
    a floor (1e-9 of the mean) so that a unit of zero mass (a dead unit) still takes part."""
    if m is None:
        return np.full(n, 1.0 / n)
    m = np.abs(_np(m).astype(np.float64).reshape(-1))
    if m.shape != (n,) or not np.isfinite(m).all():
        raise ValueError(f"unit masses must be {n} finite numbers, got shape {m.shape}")
    total = m.sum()
    if total <= 0:
        return np.full(n, 1.0 / n)
    m = m / total
    m = np.maximum(m, 1e-9 / n)
    return m / m.sum()


def optimal_transport(S, reg: float | None = None, a=None, b=None) -> SolveResult:
    """Transport plan between A's and B's units for similarity ``S``.

    ``a [n_A]`` / ``b [n_B]``: the units' masses (normalised here; uniform where None). With
    masses proportional to what each unit contributes (:mod:`symgraph.alignment.masses`), a
    unit of A that B copies k times, its outgoing weight split among the copies, receives
    exactly those copies. ``reg=None``: exact (``ot.emd``); else entropic Sinkhorn
    (``ot.sinkhorn``, log-domain below 1e-2) with that regularisation relative to the cost
    scale. The plan ``T [n_A, n_B]`` sums to 1; ``extra["plan"]`` marks it
    (``alignment.solve_unit.element_from`` makes it a map).
    """
    import ot
    s = _np(S)
    cost = s.max() - s
    scale = max(cost.max(), 1e-12)
    a, b = _marginal(a, s.shape[0]), _marginal(b, s.shape[1])
    t = time.perf_counter()
    if reg is None:
        T = ot.emd(a, b, cost / scale, numItermax=max(100000, 50 * s.size))
        status = "optimal"
    else:
        # log-domain iterations: the plain ones overflow (NaN plans) below reg ~ 1e-3
        T = ot.sinkhorn(a, b, cost / scale, reg, numItermax=2000,
                        method="sinkhorn_log" if reg < 1e-2 else "sinkhorn")
        status = "soft"
    dt = time.perf_counter() - t
    T = torch.as_tensor(T, dtype=torch.float64)
    obj = float((T * torch.as_tensor(s)).sum())
    T = T.to(S.device) if isinstance(S, torch.Tensor) else T  # back to the similarity's device
    return SolveResult(T, obj, status=status, seconds=dt, extra={"plan": True})


def _inner(kind: GroupKind, S, pairs, inner):
    if kind == "rope":
        return rope_procrustes(S, pairs)
    if kind == "orthogonal_mean" and inner != "hungarian":
        return procrustes_mean(S)
    if kind in ("orthogonal", "gl") and inner != "hungarian":
        return procrustes(S)
    if S.shape[0] == S.shape[1]:
        return hungarian(S)
    return optimal_transport(S)


def inner_blocks(kind: GroupKind, S, pairs=None, inner: str = "procrustes") -> SolveResult:
    """One inner element per block (head) of ``S [H, n_A, n_B]``, heads already paired:
    batched Procrustes / RoPE rotations, or one assignment (or transport) per head."""
    S = torch.as_tensor(S, dtype=torch.float64)
    if kind == "rope" or (kind in ("orthogonal", "orthogonal_mean", "gl") and inner != "hungarian"):
        return _inner(kind, S, pairs, inner)
    rs = [_inner(kind, S[h], pairs, inner) for h in range(S.shape[0])]
    return SolveResult(torch.stack([r.element for r in rs]), sum(r.objective for r in rs),
                       status=rs[0].status if rs else "optimal",
                       seconds=sum(r.seconds for r in rs),
                       extra={"plan": any(r.extra.get("plan") for r in rs)})


def pair_objectives(S, kind: GroupKind, pr, inner: str, given=None) -> tuple:
    """Every block pair's best inner objective of ``S [F_A, F_B, n_A, n_B]`` (float64):
    ``(obj [F_A, F_B], element [F_A, F_B, n_A, n_B] or None, seconds)``; the element is None
    for rotations (the polar factors of the matched pairs only are taken later). ``given``:
    ``[F_A, F_B]`` scores used in place of a rotation class's optimum (circuit distances)."""
    FA, FB = S.shape[:2]
    dev, secs = S.device, 0.0
    if given is not None and kind in ("orthogonal", "gl") and inner != "hungarian":
        obj, el = torch.as_tensor(given, dtype=torch.float64, device=dev), None
    elif kind in ("orthogonal", "gl") and inner != "hungarian":
        # score every head pair by its Procrustes optimum (the nuclear norm, from the
        # eigenvalues of S Sᵀ: far cheaper than H_A·H_B SVDs); rotations only for the matches
        t = time.perf_counter()
        if _on_device(S):  # every pair's polar factor, batched: matmuls on the device
            obj = (polar(S)[0] * S).sum((-1, -2))
        else:
            ev = decompose(torch.linalg.eigvalsh, S @ S.mT)
            obj = ev.clamp_min(0).sqrt().sum(-1)
        secs += time.perf_counter() - t
        el = None
    elif kind == "rope":
        res = _inner(kind, S, pr, inner)  # batched over head pairs
        el = res.element
        obj = (el * S).sum((-1, -2))
        secs += res.seconds
    else:
        el = torch.zeros_like(S)
        obj = torch.zeros(FA, FB, dtype=torch.float64, device=dev)
        for a in range(FA):
            for b in range(FB):
                r = _inner(kind, S[a, b], pr, inner)
                el[a, b], obj[a, b] = r.element, r.objective
                secs += r.seconds
    return obj, el, secs


def nested_heads(S_inner: list, kinds: list[GroupKind], pairs: list, inner: str = "procrustes",
                 outer: str = "hungarian", masses=None, scores=None) -> tuple:
    """Outer matching of heads whose cost is the best inner alignment of each head pair.

    ``S_inner[c]`` is ``[H_A, H_B, n_A, n_B]`` for inner class ``c``. Returns
    ``(outer_result, [inner element [H_B, n_A, n_B] per class])`` where the inner element of
    B's head ``b`` is the solution for its matched pair. ``inner="hungarian"`` matches head
    dimensions by permutation (Verma & Elbayad 2024); ``"procrustes"`` rotates them (Zhang et al. 2024).
    ``masses``: ``(a [H_A], b [H_B])`` head masses for a transport between head counts.
    ``scores[c]``: ``[H_A, H_B]`` (or None) scores class ``c`` adds to the outer matching in
    place of its inner optimum (e.g. circuit distances, Theus et al. 2025).
    """
    S_inner = [torch.as_tensor(S, dtype=torch.float64) for S in S_inner]
    HA, HB = S_inner[0].shape[:2]
    dev = S_inner[0].device
    score = torch.zeros(HA, HB, dtype=torch.float64, device=dev)
    sols = []
    secs = 0.0
    scores = list(scores or [None] * len(S_inner))
    for S, kind, pr, given in zip(S_inner, kinds, pairs, scores):
        obj, el, t = pair_objectives(S, kind, pr, inner, given)
        secs += t
        score += obj
        sols.append(el)
    out = (hungarian(score) if (outer == "hungarian" and HA == HB)
           else optimal_transport(score, a=(masses or (None, None))[0], b=(masses or (None, None))[1]))
    assert isinstance(out.element, torch.Tensor)  # a dense assignment or plan
    match = out.element.argmax(0).to(dev)  # B head b -> A head
    heads_b = torch.arange(HB, device=dev)
    inner_els = []
    for S, el in zip(S_inner, sols):
        if el is None:  # rotations of the matched pairs only
            res = procrustes(S[match, heads_b])
            secs += res.seconds
            inner_els.append(res.element)
        else:
            inner_els.append(el[match, heads_b])
    out.seconds += secs
    return out, inner_els


def _ranked_as_is(S) -> bool:
    """Whether :func:`hungarian` takes ``S`` in its own dtype: a square float32 tensor. Every
    comparison (row maxima, candidates) is the same in float64, whose copy of an MLP's
    similarity is 0.25 GB at n = 5632, and the objective is summed in float64 either way."""
    return isinstance(S, torch.Tensor) and S.dtype == torch.float32 and S.dim() == 2 and S.shape[0] == S.shape[1]


def solve(kind: GroupKind, S, *, pairs=None, solver: str | None = None, rescale=False,
          reg: float | None = None, dense: bool = True, masses=None) -> SolveResult:
    """Dispatch on the group kind (or an explicit ``solver``); ``dense=False``: a
    permutation comes back as a :class:`~symgraph.core.elements.Perm` (see :func:`hungarian`);
    ``masses``: ``(a, b)`` unit masses for the transport solvers (uniform where None)."""
    a, b = masses or (None, None)
    if isinstance(S, torch.Tensor) and not all_finite(S):  # finite weights whose products overflowed
        raise InputError(f"alignment: the similarity matrix of a {kind} class ({' x '.join(map(str, S.shape))}) "
                         "holds NaN/inf values; expected finite similarities (weights or activations whose "
                         "products overflow the dtype cannot be aligned)")
    if solver is None and kind == "orthogonal":
        S = _float(S)
    elif not (solver in (None, "hungarian") and kind == "perm" and _ranked_as_is(S)):
        S = torch.as_tensor(S, dtype=torch.float64)
    square = S.shape[-1] == S.shape[-2]
    if solver is None:
        if not square:
            solver = "ot"
        elif kind == "rope":
            solver = "rope"
        elif kind in ("orthogonal", "gl"):
            solver = "procrustes"
        elif kind == "orthogonal_mean":
            return procrustes_mean(S)
        elif kind == "signed_perm":
            return signed_hungarian(S)
        else:
            solver = "hungarian"
    if solver == "hungarian":
        return hungarian(S, dense)
    if solver == "procrustes":
        return procrustes(S, rescale)
    if solver == "rope":
        return rope_procrustes(S, pairs)
    if solver == "ot":
        return optimal_transport(S, a=a, b=b)
    if solver == "sinkhorn":
        return optimal_transport(S, reg=reg if reg is not None else 0.01, a=a, b=b)
    raise ValueError(f"unknown solver {solver!r}; expected one of {SOLVERS}")


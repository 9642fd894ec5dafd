"""An exact linear assignment on the similarity's device: Bertsekas' auction in torch ops.

:func:`auction` maximises ``Σ_i S[i, π(i)]`` over injections ``π`` (rows into columns; a
matrix with more rows is solved transposed) without taking ``S`` to the host. The method:

* **Integer benefits.** ``B = round((S − min S)·K)`` in int64: exact arithmetic, so the auction
  terminates and ε-complementary slackness holds exactly. An integer-valued ``S`` (ties
  included) gets ``K = n + 1`` (Bertsekas' factor: the auction's ``n·ε`` slack with ``ε = 1`` is
  below one unit of ``S``, so the assignment is exactly optimal); any other ``S`` gets the grid
  ``K = 2^44 / (max S − min S)``. A rectangular ``S`` is padded to a square with constant rows
  (which add the same to every assignment).
* **Jacobi auction with ε-scaling.** Every unassigned row bids at once for its best column, at
  the price that makes it indifferent to its second best plus ``ε``; each column takes its
  highest bid (the lowest row among equal ones) and frees its previous owner. ``ε`` falls by
  :data:`THETA` from ``V / THETA`` to 1; prices carry over between phases (shifted to a
  minimum of 0), and so do the assignments that still satisfy ε-complementary slackness.
* **Certificate.** With the final prices ``p`` (in ``S``'s units) the dual objective
  ``D = Σ_i max_j (S_ij − p_j) + Σ_j p_j`` bounds every assignment's value from above (weak
  duality), so the gap ``D − Σ_i S[i, π(i)]``, computed in float64 from ``S`` itself, bounds
  how far ``π`` can be from the optimum. It is accepted when below the grid's rounding
  (``2n/K``, plus float64 rounding): for an integer ``S`` that is below one unit, which proves
  ``π`` optimal; for a real ``S``, ``π``'s value is within about ``n·2^-43`` of the range of ``S``
  of the optimum (ties below that are ties). A failed certificate, a non-finite ``S`` or a
  phase past its round limit returns None: the caller solves on the host.
"""
from __future__ import annotations

import torch

__all__ = ["auction", "THETA", "BITS"]

#: ε falls by this factor from one phase to the next.
THETA = 8
#: Real-valued similarities are rounded to a grid of ``2^BITS`` steps over their range.
BITS = 44


def _phase(B, price, p2o, o2p, eps: int, max_rounds: int):
    """One ε-phase of the Jacobi auction on the square int64 ``B``, updating ``price``, ``p2o``
    (row → column, -1 free) and ``o2p`` (column → row, -1 free) in place; the rounds it took,
    or None past ``max_rounds``."""
    n = B.shape[0]
    dev = B.device
    ar = torch.arange(n, device=dev)
    # keep the assignments that satisfy ε-CS at the new ε; free the others
    val = B - price
    own = val.gather(1, p2o.clamp(min=0)[:, None]).squeeze(1)
    keep = (p2o >= 0) & (own >= val.amax(1) - eps)
    del val
    p2o.copy_(torch.where(keep, p2o, -1))
    o2p_ext = p2o.new_full((n + 1,), -1)
    o2p_ext.scatter_(0, torch.where(keep, p2o, n), ar)
    o2p.copy_(o2p_ext[:n])
    low = torch.iinfo(torch.int64).min
    rounds = 0
    while True:
        free = (p2o < 0).nonzero().squeeze(1)
        if free.numel() == 0:
            return rounds
        if rounds >= max_rounds:
            return None
        rounds += 1
        top = (B[free] - price).topk(2, dim=1)
        j1, w1, w2 = top.indices[:, 0], top.values[:, 0], top.values[:, 1]
        bid = price[j1] + (w1 - w2) + eps
        hi = torch.full((n,), low, dtype=torch.int64, device=dev).scatter_reduce(0, j1, bid, "amax")
        cand = torch.where(bid == hi[j1], free, n)
        who = torch.full((n,), n, dtype=torch.int64, device=dev).scatter_reduce(0, j1, cand, "amin")
        got = who < n
        # the previous owners of the columns that took a bid are free again; the winners own them
        p2o_ext = torch.cat([p2o, p2o.new_full((1,), -1)])
        p2o_ext.scatter_(0, torch.where(got & (o2p >= 0), o2p, n), -1)
        p2o_ext.scatter_(0, torch.where(got, who, n), ar)
        p2o.copy_(p2o_ext[:n])
        o2p.copy_(torch.where(got, who, o2p))
        price.copy_(torch.where(got, hi, price))


def auction(S: torch.Tensor, theta: int = THETA) -> tuple | None:
    """``(rows, cols, info)`` of a maximum assignment of ``S [n_r, n_c]`` (int64 tensors on
    ``S``'s device, rows ascending), or None where the certificate fails (see the module's
    docstring). ``info``: ``gap`` (the certified bound on the distance to the optimum),
    ``bound`` (the accepted gap), ``phases``, ``rounds``, ``exact`` (integer ``S``: the gap
    proves optimality)."""
    if S.shape[0] > S.shape[1]:
        out = auction(S.mT, theta)
        if out is None:
            return None
        rows, cols, info = out
        order = torch.argsort(cols)
        return cols[order], rows[order], info
    nr, n = S.shape
    dev = S.device
    s = S.detach().to(torch.float64)
    if nr == 0:
        e = torch.zeros(0, dtype=torch.int64, device=dev)
        return e, e, {"gap": 0.0, "bound": 0.0, "phases": 0, "rounds": 0, "exact": True}
    if not bool(torch.isfinite(s).all()):
        return None
    lo, hi = float(s.amin()), float(s.amax())
    if nr < n:  # constant rows: every assignment of the real rows gains the same
        s = torch.cat([s, s.new_full((n - nr, n), lo)])
    rng = hi - lo
    exact = bool((s == s.round()).all()) and rng * (n + 1) <= 2.0 ** BITS
    K = float(n + 1) if exact else (2.0 ** BITS / rng if rng > 0 else 1.0)
    B = ((s - lo) * K).round().to(torch.int64)
    V = int(B.amax())
    price = torch.zeros(n, dtype=torch.int64, device=dev)
    p2o = torch.full((n,), -1, dtype=torch.int64, device=dev)
    o2p = torch.full((n,), -1, dtype=torch.int64, device=dev)
    phases = rounds = 0
    if n == 1:
        p2o.zero_()
    else:
        eps = max(1, V // theta)
        while True:
            r = _phase(B, price, p2o, o2p, eps, max_rounds=20 * n + 1000)
            if r is None:
                return None
            phases, rounds = phases + 1, rounds + r
            if eps == 1:
                break
            price -= price.amin()
            eps = max(1, eps // theta)
    # the certificate, in float64 from S itself
    p = price.to(torch.float64) / K
    primal = s.gather(1, p2o[:, None]).squeeze(1)
    gap = float((s - p).amax(1).sum() + p.sum() - primal.sum())
    scale = max(abs(lo), abs(hi)) + float(p.abs().amax())
    if exact:
        bound = 1.0 - 0.5 / (n + 1)
    else:
        bound = 2.0 * n / K + 64.0 * n * torch.finfo(torch.float64).eps * scale
    if not gap <= bound:
        return None
    rows = torch.arange(nr, device=dev)
    info = {"gap": max(gap, 0.0), "bound": bound, "phases": phases, "rounds": rounds, "exact": exact}
    return rows, p2o[:nr], info

"""The solvers of ``symgraph.solve`` against brute force and closed forms.

The Hungarian tests force each of its two paths: a similarity whose row maxima collide must go
through the linear-sum assignment (checked against the optimum over all permutations); one whose
row maxima are distinct takes the row-maxima shortcut, which must agree with the assignment.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from symgraph.solve import _solvers, hungarian, optimal_transport, procrustes, rope_procrustes

F64 = torch.float64
LSAP_STATUS = "optimal"
SHORTCUT_STATUS = "optimal (row maxima)"


@pytest.fixture
def lsap_calls(monkeypatch):
    """Count the calls of the linear-sum assignment inside ``hungarian``."""
    calls = []
    real = _solvers.linear_sum_assignment

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(_solvers, "linear_sum_assignment", spy)
    return calls


def _brute_force(S: torch.Tensor) -> tuple[float, tuple]:
    """Best ``Σ_i S[i, π(i)]`` over all injections π of rows into columns, and its π."""
    n_a, n_b = S.shape
    s = S.tolist()
    best = max(itertools.permutations(range(n_b), n_a), key=lambda p: sum(s[i][p[i]] for i in range(n_a)))
    return sum(s[i][best[i]] for i in range(n_a)), best


def _colliding(seed: int, n: int = 6) -> torch.Tensor:
    """Random similarity where rows 0..2 all have their maximum in one column (argmaxes collide),
    so the best assignment is not the row maxima."""
    g = torch.Generator().manual_seed(seed)
    S = torch.rand(n, n, generator=g, dtype=F64)
    col = int(torch.randint(0, n, (1,), generator=g))
    S[:3, col] += 1.0 + torch.rand(3, generator=g, dtype=F64)
    am = S.argmax(1)
    assert am.unique().numel() < n  # the shortcut cannot apply
    return S


def _check_permutation(P: torch.Tensor):
    assert P.dtype == F64
    assert bool(((P == 0) | (P == 1)).all())
    assert torch.equal(P.sum(1), torch.ones(P.shape[0], dtype=F64))
    assert bool((P.sum(0) <= 1).all())


@pytest.mark.parametrize("seed", range(6))
def test_hungarian_lsap_matches_brute_force(seed, lsap_calls):
    S = _colliding(seed)
    r = hungarian(S)
    assert lsap_calls == [(6, 6)]  # the assignment really ran
    assert r.status == LSAP_STATUS
    _check_permutation(r.element)
    best, perm = _brute_force(S)
    assert r.objective == pytest.approx(best, abs=1e-12)
    assert r.objective == pytest.approx(float((r.element * S).sum()), abs=1e-12)
    # random scores: the optimum is unique, so the permutation itself is the brute-force one
    assert r.element.argmax(1).tolist() == list(perm)
    # and it beats the (infeasible) row maxima's collision: no two rows share a column
    assert r.objective < float(S.max(1).values.sum())


def test_hungarian_rectangular_lsap_matches_brute_force(lsap_calls):
    g = torch.Generator().manual_seed(11)
    S = torch.rand(4, 6, generator=g, dtype=F64)
    r = hungarian(S)
    assert lsap_calls == [(4, 6)] and r.status == LSAP_STATUS
    _check_permutation(r.element)
    best, perm = _brute_force(S)
    assert r.objective == pytest.approx(best, abs=1e-12)
    assert r.element.argmax(1).tolist() == list(perm)


@pytest.mark.parametrize("seed", range(4))
def test_hungarian_row_maxima_shortcut_agrees_with_lsap(seed, lsap_calls, monkeypatch):
    g = torch.Generator().manual_seed(100 + seed)
    n = 6
    truth = torch.randperm(n, generator=g)
    S = torch.rand(n, n, generator=g, dtype=F64)
    S[torch.arange(n), truth] += 1.0  # every row's maximum in its own column
    assert S.argmax(1).unique().numel() == n

    fast = hungarian(S)
    assert fast.status == SHORTCUT_STATUS and lsap_calls == []
    monkeypatch.setattr(_solvers, "ROW_MAXIMA", False)
    slow = hungarian(S)
    assert slow.status == LSAP_STATUS and lsap_calls == [(n, n)]

    assert torch.equal(fast.element, slow.element)
    assert fast.element.argmax(1).tolist() == truth.tolist()
    assert fast.objective == pytest.approx(slow.objective, abs=1e-12)
    assert fast.objective == pytest.approx(_brute_force(S)[0], abs=1e-12)


def test_hungarian_permutation_input(lsap_calls, monkeypatch):
    P = torch.eye(5, dtype=F64)[torch.randperm(5, generator=torch.Generator().manual_seed(0))]
    for row_maxima in (True, False):
        monkeypatch.setattr(_solvers, "ROW_MAXIMA", row_maxima)
        r = hungarian(P)
        assert torch.equal(r.element, P) and r.objective == 5.0
        assert r.status == (SHORTCUT_STATUS if row_maxima else LSAP_STATUS)
    assert lsap_calls == [(5, 5)]  # only with the shortcut off


def _random_orthogonal(n, g):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return Q


def test_procrustes_recovers_rotation():
    g = torch.Generator().manual_seed(0)
    Q = _random_orthogonal(6, g)
    C = torch.randn(6, 6, generator=g, dtype=F64)
    C = C @ C.T + 6 * torch.eye(6, dtype=F64)  # symmetric positive definite
    S = C @ Q
    r = procrustes(S)
    torch.testing.assert_close(r.element, Q, atol=1e-8, rtol=0)
    # the optimum of <R, C Q> over orthogonal R is tr(C) (the nuclear norm of S)
    assert r.objective == pytest.approx(float(torch.trace(C)), rel=1e-10)
    assert r.objective == pytest.approx(float((r.element * S).sum()), rel=1e-10)
    for _ in range(20):  # no orthogonal matrix does better
        assert float((_random_orthogonal(6, g) * S).sum()) < r.objective


def test_procrustes_random_similarity_is_orthogonal_optimum():
    g = torch.Generator().manual_seed(1)
    S = torch.randn(5, 5, generator=g, dtype=F64)
    r = procrustes(S)
    torch.testing.assert_close(r.element @ r.element.T, torch.eye(5, dtype=F64), atol=1e-10, rtol=0)
    assert r.objective == pytest.approx(float(torch.linalg.matrix_norm(S, "nuc")), rel=1e-10)
    assert r.objective == pytest.approx(float((r.element * S).sum()), rel=1e-10)


def _rot(n, pairs_angles):
    R = torch.eye(n, dtype=F64)
    for (i, j), th in pairs_angles:
        c, s = math.cos(th), math.sin(th)
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def test_rope_procrustes_recovers_block_rotation():
    R = _rot(4, [((0, 2), 0.7), ((1, 3), -2.1)])
    r = rope_procrustes(R, [(0, 2), (1, 3)])
    torch.testing.assert_close(r.element, R, atol=1e-12, rtol=0)
    assert r.objective == pytest.approx(4.0, abs=1e-12)  # <R, R> = n


def test_rope_procrustes_batched_beats_every_angle():
    g = torch.Generator().manual_seed(2)
    S = torch.randn(3, 4, 4, generator=g, dtype=F64)
    pairs = [(0, 1), (2, 3)]
    r = rope_procrustes(S, pairs)
    assert r.element.shape == (3, 4, 4)
    assert r.objective == pytest.approx(float((r.element * S).sum()), abs=1e-10)
    # per block and per pair the angle is optimal: a grid of angles never does better
    for h in range(3):
        got = float((r.element[h] * S[h]).sum())
        for a in np.linspace(-math.pi, math.pi, 25):
            for b in np.linspace(-math.pi, math.pi, 25):
                assert float((_rot(4, [((0, 1), a), ((2, 3), b)]) * S[h]).sum()) <= got + 1e-12


def test_optimal_transport_exact():
    P = torch.eye(4, dtype=F64)[[2, 0, 3, 1]]
    r = optimal_transport(P)
    assert r.status == "optimal"
    torch.testing.assert_close(r.element * 4, P, atol=1e-12, rtol=0)
    assert r.objective == pytest.approx(1.0, abs=1e-12)
    T = optimal_transport(torch.eye(3, dtype=F64)).element
    torch.testing.assert_close(T * 3, torch.eye(3, dtype=F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_optimal_transport_square_equals_assignment(seed):
    """Uniform marginals on a square similarity: the transport optimum is a vertex of the
    Birkhoff polytope, i.e. the best permutation divided by n."""
    g = torch.Generator().manual_seed(200 + seed)
    S = torch.rand(6, 6, generator=g, dtype=F64)
    r = optimal_transport(S)
    torch.testing.assert_close(r.element.sum(0), torch.full((6,), 1 / 6, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(r.element.sum(1), torch.full((6,), 1 / 6, dtype=F64), atol=1e-12, rtol=0)
    assert r.objective * 6 == pytest.approx(_brute_force(S)[0], abs=1e-9)
    assert r.objective * 6 == pytest.approx(hungarian(S).objective, abs=1e-9)


def test_optimal_transport_rectangular_and_sinkhorn_marginals():
    g = torch.Generator().manual_seed(3)
    S = torch.rand(3, 5, generator=g, dtype=F64)
    exact = optimal_transport(S)
    torch.testing.assert_close(exact.element.sum(1), torch.full((3,), 1 / 3, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(exact.element.sum(0), torch.full((5,), 1 / 5, dtype=F64), atol=1e-12, rtol=0)
    soft = optimal_transport(S, reg=0.05)
    assert soft.status == "soft"
    torch.testing.assert_close(soft.element.sum(1), torch.full((3,), 1 / 3, dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(soft.element.sum(0), torch.full((5,), 1 / 5, dtype=F64), atol=1e-6, rtol=0)
    assert soft.objective <= exact.objective + 1e-12  # entropic plan never beats the exact one


def test_sinkhorn_converges_at_small_reg():
    g = torch.Generator().manual_seed(0)
    P = torch.eye(48, dtype=torch.float64)[torch.randperm(48, generator=g)]
    S = P + 0.1 * torch.randn(48, 48, generator=g, dtype=torch.float64)
    for reg in (1e-2, 1e-3, 1e-4):
        res = optimal_transport(S, reg=reg)
        T = res.element
        assert res.status == "soft" and res.extra["plan"] and torch.isfinite(T).all()
        torch.testing.assert_close(T.sum(1), torch.full((48,), 1 / 48, dtype=torch.float64), atol=1e-9, rtol=0)
        torch.testing.assert_close(T.sum(0), torch.full((48,), 1 / 48, dtype=torch.float64), atol=1e-9, rtol=0)
        if reg <= 1e-3:  # nearly the permutation
            assert torch.equal(T.argmax(1), P.argmax(1))

"""The solvers' device paths: the Newton–Schulz polar factor (``solve._polar``) against the SVD,
and the auction (``solve._auction``) against SciPy's linear_sum_assignment, on CPU tensors and
on the ``fakegpu`` test device (where ``procrustes`` / ``hungarian`` take these paths)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symgraph.solve import _auction, _solvers as SV
from symgraph.solve._auction import auction
from symgraph.solve._polar import polar, polar_from_svd

F64 = torch.float64


@pytest.fixture(scope="module")
def dev():
    from symgraph.testing.device import install
    return torch.device(install())


def _svd_polar(M):
    U, _, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    return U @ Vh


def _conditioned(shape, cond, seed, dtype=F64):
    """``[*b, m, n]`` with singular values log-spaced from 1 to ``1/cond``."""
    *b, m, n = shape
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*b, m, k, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(*b, n, k, generator=g, dtype=F64))
    sv = torch.logspace(0, -float(np.log10(cond)), k, dtype=F64)
    return ((U * sv) @ V.mT).to(dtype)


# ---------------------------------------------------------------- polar factor

@pytest.mark.parametrize("shape", [(3, 1, 1), (5, 2, 2), (64, 64), (512, 512), (4, 16, 16), (40, 24), (24, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_polar_equals_the_svd_on_well_conditioned_matrices(shape, dtype):
    # condition 100; 10 for a rectangular one (float32 rounding in the early steps moves its
    # semi-orthogonal factor by about eps·κ²: 2e-5 at κ = 100, where the float32 SVD gives 5e-7)
    M = _conditioned(shape, 100.0 if shape[-1] == shape[-2] else 10.0, seed=sum(shape), dtype=dtype)
    Q, info = polar(M)
    assert Q.dtype == dtype and Q.shape == M.shape and info["fallback"] == 0
    assert 0 < info["iterations"] <= 20
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert float((Q.double() - _svd_polar(M)).abs().max()) < tol
    # (semi-)orthogonal to working precision, and the optimum <Q, M> = Σσ
    k = min(shape[-2:])
    G = Q.mT @ Q if shape[-2] >= shape[-1] else Q @ Q.mT
    assert float((G.double() - torch.eye(k, dtype=F64)).abs().max()) < (1e-5 if dtype == torch.float32 else 1e-13)
    nuc = torch.linalg.svdvals(M.double()).sum()
    assert float((Q.double() * M.double()).sum()) == pytest.approx(float(nuc), rel=1e-6 if dtype == torch.float32 else 1e-12)


def test_polar_on_random_gaussian_matrices():
    """Plain Gaussian matrices (condition numbers of a few hundred) converge within the schedule."""
    g = torch.Generator().manual_seed(5)
    for n in (8, 64, 256):
        M = torch.randn(n, n, generator=g)
        Q, info = polar(M)
        assert info["fallback"] == 0 and info["iterations"] <= 15
        assert float((Q.double() - _svd_polar(M)).abs().max()) < 1e-4  # cond ~ n: float32's own limit


def test_polar_on_the_solver_tests_matrices():
    """test_solvers' Procrustes matrices: a rotation behind an SPD factor, and a random 5×5."""
    g = torch.Generator().manual_seed(0)
    Qr, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=F64))
    C = torch.randn(6, 6, generator=g, dtype=F64)
    C = C @ C.T + 6 * torch.eye(6, dtype=F64)
    S2 = torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    for M, want in ((C @ Qr, Qr), (S2, _svd_polar(S2))):
        for dtype, tol in ((F64, 1e-12), (torch.float32, 1e-5)):
            Q, info = polar(M.to(dtype))
            assert info["fallback"] == 0
            assert float((Q.double() - want).abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_polar_falls_back_to_the_svd(dtype):
    """Rank-deficient (polar factor not unique) and badly conditioned matrices go to the SVD,
    which decides as the SVD path does; well-conditioned ones beside them in a batch do not."""
    g = torch.Generator().manual_seed(3)
    low_rank = (torch.randn(32, 30, generator=g, dtype=F64) @ torch.randn(30, 32, generator=g, dtype=F64)).to(dtype)
    bad = _conditioned((32, 32), 1e9, seed=4, dtype=dtype)
    good = _conditioned((32, 32), 10.0, seed=5, dtype=dtype)
    for M in (low_rank, bad):
        Q, info = polar(M)
        assert info["fallback"] == 1
        U, S, Vh = torch.linalg.svd(M, full_matrices=False)  # the SVD path's factor, with its free
        assert torch.equal(Q, polar_from_svd(U, S, Vh))     # part kept closest to the identity
        if M is low_rank:  # two free directions: not the SVD's arbitrary basis of them
            assert not torch.equal(Q, U @ Vh)
    zero = torch.zeros(32, 32, dtype=dtype)
    Q, info = polar(torch.stack([good, low_rank, bad, zero]))
    assert info["fallback"] == 3
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert float((Q[0].double() - _svd_polar(good)).abs().max()) < tol
    assert torch.equal(Q[1], polar_from_svd(*torch.linalg.svd(low_rank.unsqueeze(0)))[0])
    nan = good.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError):  # as the SVD path does
        polar(nan)


def test_procrustes_on_a_device_uses_the_polar_iteration(dev, monkeypatch):
    """On ``fakegpu``: Procrustes (single, batched over heads, mean-free, nested heads) and the
    RoPE rotations take the device paths, stay on the device and equal the CPU's SVD results."""
    calls = []
    real = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    S = torch.randn(24, 24, generator=g, dtype=F64) + 4 * torch.eye(24, dtype=F64)
    heads = torch.randn(3, 16, 16, generator=g, dtype=F64) + 3 * torch.eye(16, dtype=F64)
    for fn, x, tol in ((SV.procrustes, S, 1e-12), (SV.procrustes, S.float(), 1e-5),
                       (SV.procrustes, heads, 1e-12), (SV.procrustes_mean, S, 1e-12)):
        want = fn(x)
        calls.clear()
        got = fn(x.to(dev))
        assert calls == [] and got.element.device.type == dev.type
        assert float((got.element.cpu().double() - want.element.double()).abs().max()) < tol
        assert got.objective == pytest.approx(want.objective, rel=1e-6 if x.dtype == torch.float32 else 1e-12)
    pairs = [(0, 2), (1, 3), (4, 5)]
    want, got = SV.rope_procrustes(heads[:, :6, :6], pairs), SV.rope_procrustes(heads[:, :6, :6].to(dev), pairs)
    assert got.element.device.type == dev.type
    torch.testing.assert_close(got.element.cpu(), want.element, atol=1e-14, rtol=0)
    assert got.objective == pytest.approx(want.objective, rel=1e-14)
    nest = torch.randn(3, 3, 12, 12, generator=g, dtype=F64)
    nest[torch.arange(3), torch.tensor([1, 2, 0])] += 3 * torch.eye(12, dtype=F64)
    want_out, want_in = SV.nested_heads([nest], ["orthogonal"], [None])
    calls.clear()
    out, inner = SV.nested_heads([nest.to(dev)], ["orthogonal"], [None])
    assert calls == [] and inner[0].device.type == dev.type
    assert out.element.cpu().argmax(0).tolist() == want_out.element.argmax(0).tolist() == [2, 0, 1]
    assert float((inner[0].cpu() - want_in[0]).abs().max()) < 1e-12


# ---------------------------------------------------------------- assignment

def _scipy(S):
    s = S.double().cpu().numpy()
    r, c = linear_sum_assignment(s, maximize=True)
    return float(s[r, c].sum())


def _check_auction(S):
    out = auction(S)
    assert out is not None
    rows, cols, info = out
    k = min(S.shape)
    assert rows.tolist() == sorted(rows.tolist()) and len(set(rows.tolist())) == len(set(cols.tolist())) == k
    obj = float(S.double()[rows, cols].sum())
    want = _scipy(S)
    assert info["gap"] <= info["bound"]
    assert abs(obj - want) <= max(info["bound"], 1e-12 * abs(want))
    return obj, want, info


def _degenerate():
    g = torch.Generator().manual_seed(21)
    rep = torch.rand(30, 30, generator=g, dtype=F64)
    rep[10:20] = rep[0]
    return {
        "constant": torch.full((12, 12), 0.5, dtype=F64),
        "repeated rows": rep,
        "rank one": torch.rand(40, 1, generator=g, dtype=F64) @ torch.rand(1, 40, generator=g, dtype=F64),
        "integer ties": torch.randint(0, 3, (50, 50), generator=g).to(F64),
        "integer range": torch.randint(-1000, 1000, (64, 64), generator=g).to(F64),
        "permutation": torch.eye(9, dtype=F64)[torch.randperm(9, generator=g)],
        "wide": torch.rand(5, 9, generator=g, dtype=F64),
        "tall": torch.rand(9, 5, generator=g, dtype=F64),
        "wide integer": torch.randint(0, 4, (7, 20), generator=g).to(F64),
        "float32": torch.randn(64, 64, generator=g),
    }


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_auction_equals_scipy_on_random_matrices(n):
    S = torch.rand(n, n, generator=torch.Generator().manual_seed(n), dtype=F64)
    obj, want, info = _check_auction(S)
    assert abs(obj - want) <= 1e-12 * max(1.0, want)


@pytest.mark.parametrize("name", list(_degenerate()))
def test_auction_equals_scipy_on_degenerate_matrices(name):
    S = _degenerate()[name]
    obj, want, info = _check_auction(S)
    if bool((S == S.round()).all()):  # integer data: the certificate proves the optimum
        assert info["exact"] and obj == want


def test_auction_refuses_what_it_cannot_certify():
    assert auction(torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=F64)) is None


def test_hungarian_on_a_device_runs_the_auction(dev, monkeypatch):
    """On ``fakegpu`` the assignment is the auction's (SciPy not called), on the device; the
    permutation and objective are SciPy's. A failed certificate falls back to SciPy, and below
    ``AUCTION_MIN`` SciPy solves."""
    monkeypatch.setattr(SV, "AUCTION_MIN", 1)  # small matrices go to the host by default
    lsap = []
    real = SV.linear_sum_assignment
    monkeypatch.setattr(SV, "linear_sum_assignment", lambda *a, **k: lsap.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(9)
    cases = [torch.rand(20, 20, generator=g, dtype=F64), torch.rand(6, 10, generator=g, dtype=F64),
             torch.randint(0, 3, (16, 16), generator=g).to(F64)]
    for S in cases:
        S[:3, 0] += 2.0  # colliding row maxima: the assignment itself runs
        want = SV.hungarian(S)
        lsap.clear()
        got = SV.hungarian(S.to(dev))
        assert lsap == [] and got.status == "optimal (device auction)"
        assert got.element.device.type == dev.type
        assert got.objective == pytest.approx(want.objective, abs=1e-12)
        if not bool((S == S.round()).all()):  # ties aside, the same permutation
            assert torch.equal(got.element.cpu(), want.element)
    perm = SV.hungarian(cases[0].to(dev), dense=False)
    assert perm.element.index.device.type == dev.type and perm.status == "optimal (device auction)"
    monkeypatch.setattr(SV, "AUCTION_MIN", 21)
    lsap.clear()
    assert SV.hungarian(cases[0].to(dev)).status == "optimal" and lsap == [1]
    phase = _auction._phase
    monkeypatch.setattr(SV, "AUCTION_MIN", 1)
    monkeypatch.setattr(_auction, "_phase", lambda B, p, a, b, eps, max_rounds: phase(B, p, a, b, max(eps, 2 ** 40), max_rounds))
    lsap.clear()
    got = SV.hungarian(cases[0].to(dev))
    assert lsap == [1] and got.status == "optimal" and got.objective == pytest.approx(_scipy(cases[0]), abs=1e-12)

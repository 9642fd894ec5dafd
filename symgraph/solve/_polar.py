"""The orthogonal polar factor by matrix products: Procrustes without an SVD.

For ``M = U Σ Vᵀ`` (``[*, m, n]``) the polar factor ``Q = U Vᵀ`` maximises ``<Q, M>`` over
(semi-)orthogonal ``Q``; on an accelerator an SVD runs at a small fraction of the device's
matmul rate, the iteration below at its full rate.

The iteration is Newton–Schulz with Chen & Chow's scaling (SIAM J. Sci. Comput. 2014, "A stable
scaling of Newton–Schulz for improving the sign function computation of a Hermitian matrix"):
``X ← ½ α X (3I − α² XᵀX)``, which keeps the singular vectors and maps each singular value
``x ↦ ½ α x (3 − α² x²)``. Starting from ``X₀ = M / s`` with ``s ≥ σ_max(M)``, and with every
singular value of ``X_k`` in ``[ℓ_k, 1]``, the scaling ``α_k = √(3 / (1 + ℓ_k + ℓ_k²))`` maps that
interval into ``[ℓ_{k+1}, 1]``, ``ℓ_{k+1} = ½ α_k ℓ_k (3 − α_k² ℓ_k²)``: small singular values grow
by up to ``3√3/2 ≈ 2.6`` a step (plain Newton–Schulz: 1.5), and the iteration turns into plain
Newton–Schulz (quadratic) as ``ℓ_k → 1``. The schedule of ``α_k`` is fixed by :data:`LOW`, the
smallest ``σ_min / s`` it is designed for (13 steps from ``1e-4``); smaller singular values still
grow, by at least 1.5 a step, within :data:`EXTRA` further steps. Each step is two products
(``XᵀX`` and ``X·(aI + bXᵀX)``); ``s = min(‖MᵀM‖_F, ‖MᵀM‖_1)^{1/2}`` (at most ``n^{1/4} σ_max``).

Convergence: the orthogonality residual ``‖XᵀX − I‖_F``, available at each step from the product
the next step needs, must fall to ``TOL · √n · eps`` (the floor of an exactly orthogonal matrix
in that dtype is about ``3 √n eps``); the step size ``‖X_{k+1} − X_k‖_F`` is recorded with it.
A matrix that does not converge within the schedule and :data:`EXTRA` steps is rank-deficient
or badly conditioned (some ``σ / s`` well below :data:`LOW`): its polar factor is not unique or
not determined to working precision, and it goes to the SVD (``U Vᵀ``), which decides as the
SVD path always did. So do matrices with a non-finite entry or ``M = 0``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["polar", "polar_from_svd", "decompose", "LOW", "EXTRA", "TOL", "DEVICE_BATCH_MAX"]

#: The smallest ``σ_min / s`` the scaled schedule is designed for.
LOW = 1e-4
#: Steps allowed after the schedule (plain Newton–Schulz) before the SVD takes over.
EXTRA = 6
#: Converged when ``‖XᵀX − I‖_F ≤ TOL · √n · eps(dtype)``.
TOL = 16.0


def _schedule(low: float) -> list[tuple[float, float]]:
    """``(a, b)`` of each scaled step ``X ← a X + b X (XᵀX)`` until ``ℓ_k`` reaches 1 in double
    precision (``a = 3α/2``, ``b = −α³/2``)."""
    out: list[tuple[float, float]] = []
    lo = low
    while 1.0 - lo > 1e-12 and len(out) < 64:
        alpha = math.sqrt(3.0 / (1.0 + lo + lo * lo))
        out.append((1.5 * alpha, -0.5 * alpha ** 3))
        lo = 0.5 * alpha * lo * (3.0 - alpha * alpha * lo * lo)
    return out


_SCHEDULE: dict = {}


#: PyTorch's CUDA eigh and SVD batch matrices of at most this size (``linalg_eigh_cusolver``:
#: syevjBatched up to 32²); a batch of larger ones runs one matrix after another.
DEVICE_BATCH_MAX = 32


def _host(x: torch.Tensor) -> bool:
    """Whether a batched decomposition of ``x`` goes to the host's LAPACK: ``x`` lies on an
    accelerator and is a batch of matrices its kernels would decompose one by one (1024 head
    pairs of 128² at a 7B shape: seconds a layer on a GPU; a fraction of one on the host). The
    results go back to ``x``'s device."""
    return x.device.type != "cpu" and x.dim() > 2 and x.shape[:-2].numel() > 1 and x.shape[-1] > DEVICE_BATCH_MAX


def decompose(fn, x: torch.Tensor, **kw):
    """``fn(x, **kw)`` (a ``torch.linalg`` decomposition), on the host for a batch that the
    device's kernels would solve one matrix at a time (see :func:`_host`); the results on
    ``x``'s device."""
    if not _host(x):
        return fn(x, **kw)
    out = fn(x.cpu(), **kw)
    return out.to(x.device) if isinstance(out, torch.Tensor) else tuple(o.to(x.device) for o in out)


def _svd_polar(M: torch.Tensor) -> torch.Tensor:
    U, sig, Vh = decompose(torch.linalg.svd, M, full_matrices=False)
    return polar_from_svd(U, sig, Vh)


def polar_from_svd(U: torch.Tensor, sig: torch.Tensor, Vh: torch.Tensor) -> torch.Tensor:
    """The polar factor ``U Vᵀ`` of ``M = U Σ Vᵀ`` (``[*, m, n]``, reduced SVD), where ``M``
    leaves part of it free (singular values at rounding level, by ``torch.linalg.matrix_rank``'s
    default ``σ_max · max(m, n) · eps``; ``M = 0``) taken as close to the identity as the rest
    allows: ``U_r V_rᵀ + U_0 Q V_0ᵀ``, ``Q`` the polar factor of ``U_0ᵀ I V_0``. Every such
    factor maximises ``<Q, M>``; this one keeps the order it was given where nothing says
    otherwise (a similarity of fewer observations than units: a class solved from part of its
    slots; a model aligned to itself), where the SVD's basis of the free part is arbitrary."""
    R = U @ Vh
    if sig.numel() == 0:
        return R
    m, n = U.shape[-2], Vh.shape[-1]
    free = sig <= sig.amax(-1, keepdim=True) * (max(m, n) * torch.finfo(sig.dtype).eps)
    if not bool(free.any()):
        return R
    R, eye = R.clone(), torch.eye(m, n, dtype=R.dtype, device=R.device)
    Rf, Uf, Vf = R.view(-1, m, n), U.reshape(-1, m, U.shape[-1]), Vh.reshape(-1, *Vh.shape[-2:])
    ff = free.reshape(-1, free.shape[-1])
    for i in ff.any(-1).nonzero().flatten().tolist():
        k = ff[i]
        U0, V0 = Uf[i][:, k], Vf[i][k].mT
        Ub, _, Vbh = torch.linalg.svd(U0.mT @ eye @ V0)
        Rf[i] = Uf[i][:, ~k] @ Vf[i][~k] + U0 @ (Ub @ Vbh) @ V0.mT
    return R


def polar(M: torch.Tensor, low: float = LOW, extra: int = EXTRA) -> tuple[torch.Tensor, dict]:
    """The polar factor ``U Vᵀ`` of ``M [*, m, n]`` (float32 or float64, computed in that dtype
    on ``M``'s device) and a record: ``iterations`` (steps taken), ``residual`` (the largest
    final ``‖XᵀX − I‖_F`` among the converged matrices), ``step`` (the last step's largest
    ``‖ΔX‖_F``), ``fallback`` (how many matrices of the batch went to the SVD)."""
    if M.shape[-2] < M.shape[-1]:  # the smaller Gram matrix: polar(Mᵀ)ᵀ
        Q, info = polar(M.mT, low, extra)
        return Q.mT, info
    lead, (m, n) = M.shape[:-2], M.shape[-2:]
    info = {"iterations": 0, "residual": 0.0, "step": 0.0, "fallback": 0}
    if M.numel() == 0:
        return M.clone(), info
    X = M.reshape(-1, m, n)
    eps = torch.finfo(X.dtype).eps
    tol = TOL * math.sqrt(n) * eps
    eye = torch.eye(n, dtype=X.dtype, device=X.device)
    A = X.mT @ X
    bound = torch.minimum(torch.linalg.matrix_norm(A), A.abs().sum(-2).amax(-1))  # ≥ σ_max²
    ok = torch.isfinite(bound) & (bound > 0)
    s = torch.where(ok, bound, torch.ones_like(bound)).sqrt()
    X = X / s[:, None, None]
    A = A / (s * s)[:, None, None]
    steps = _SCHEDULE.setdefault(low, _schedule(low))
    r, step = torch.full_like(s, math.inf), torch.zeros_like(s)
    for k in range(len(steps) + extra + 1):
        if k >= len(steps) - 2:  # the scaled steps before cannot have converged: no sync
            r = torch.linalg.matrix_norm(A - eye)
            if bool(((r <= tol) | ~ok).all()):
                break
        if k == len(steps) + extra:
            break
        a, b = steps[k] if k < len(steps) else (1.5, -0.5)
        Xn = torch.baddbmm(X, X, A, beta=a, alpha=b)
        step = torch.linalg.matrix_norm(Xn - X)
        X = Xn
        A = X.mT @ X
        info["iterations"] = k + 1
    conv = ok & (r <= tol)
    if bool(conv.any()):
        info["residual"] = float(r[conv].amax())
        info["step"] = float(step[conv].amax()) if info["iterations"] else 0.0
    bad = (~conv).nonzero().squeeze(1)
    if bad.numel():
        info["fallback"] = int(bad.numel())
        X = X.clone()
        X[bad] = _svd_polar(M.reshape(-1, m, n)[bad])
    return X.reshape(*lead, m, n), info

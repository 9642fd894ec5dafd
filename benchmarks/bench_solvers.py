"""The solvers' device paths against the host's: the Newton–Schulz polar factor
(``symgraph.solve._polar``) against the SVD, and the auction (``symgraph.solve._auction``)
against SciPy's ``linear_sum_assignment``: time and agreement.

    python -m benchmarks.bench_solvers [--device cpu] [--out benchmarks/results/solvers]
                                       [--polar 256 1024 2048] [--assign 256 1024]

Polar factor, float32, per size ``n``: two matrices, a Gaussian one (``randn``: condition number
of the order of ``n``) and one with singular values log-spaced from 1 to 1/100; for each the
iteration's steps, fallbacks and time, the float32 SVD's time (``U Vᵀ``), and both results' largest
entry-wise deviation from the float64 SVD's. Assignment, per size: a uniform random similarity and
a noisy permutation (``P + 0.3·N(0, 1)``, what aligning two related models looks like), float64;
the auction's time, phases, rounds and certified gap against SciPy's time and objective (the
float64 similarity taken to the host is part of SciPy's time on a device). Times are the best of
``--repeat`` calls after a warm-up (synchronised on CUDA). On the CPU this measures the work, not
the device's rate: the iteration is matmuls (``~26 n³`` multiply-adds), the SVD ``~11 n³``.

Results: ``results.json`` (with the commit) and ``report.md`` in ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np
import torch

from .provenance import REPO_ROOT, git_state, write_result

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "solvers"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(f, repeat, device):
    out = f()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def _matrix(kind, n, g):
    if kind == "gaussian":
        return torch.randn(n, n, generator=g, dtype=torch.float64)
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (U * torch.logspace(0, -2, n, dtype=torch.float64)) @ V.mT


def bench_polar(n, device, repeat, seed=0):
    from symgraph.solve._polar import polar
    g = torch.Generator().manual_seed(seed + n)
    rows = []
    for kind in ("gaussian", "cond100"):
        M64 = _matrix(kind, n, g)
        U, _, Vh = torch.linalg.svd(M64)
        ref = U @ Vh
        M = M64.float().to(device)
        t_it, (Q, info) = _best(lambda: polar(M), repeat, device)

        def svd():
            U, _, Vh = torch.linalg.svd(M, full_matrices=False)
            return U @ Vh
        t_svd, R = _best(svd, repeat, device)
        rows.append({"n": n, "matrix": kind, "dtype": "float32", "iterations": info["iterations"],
                     "fallback": info["fallback"], "residual": info["residual"],
                     "iterative_s": t_it, "svd_s": t_svd,
                     "iterative_dev_from_svd64": float((Q.cpu().double() - ref).abs().max()),
                     "svd32_dev_from_svd64": float((R.cpu().double() - ref).abs().max()),
                     "iterative_vs_svd32": float((Q.cpu().double() - R.cpu().double()).abs().max())})
        print(rows[-1], flush=True)
    return rows


def bench_assign(n, device, repeat, seed=0):
    from scipy.optimize import linear_sum_assignment
    from symgraph.solve._auction import auction
    g = torch.Generator().manual_seed(seed + n)
    rows = []
    for kind in ("uniform", "noisy_perm"):
        if kind == "uniform":
            S = torch.rand(n, n, generator=g, dtype=torch.float64)
        else:
            S = torch.eye(n, dtype=torch.float64)[torch.randperm(n, generator=g)]
            S = S + 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64)
        Sd = S.to(device)
        t_a, out = _best(lambda: auction(Sd), repeat, device)
        t_s, (r, c) = _best(lambda: linear_sum_assignment(Sd.cpu().numpy(), maximize=True), repeat, device)
        s = S.numpy()
        want = float(s[r, c].sum())
        row = {"n": n, "matrix": kind, "scipy_s": t_s, "auction_s": t_a, "scipy_objective": want,
               "certified": out is not None}
        if out is not None:
            rows_, cols, info = out
            cols = cols.cpu().numpy()
            row |= {"objective_diff": float(s[np.arange(n), cols].sum()) - want,
                    "same_permutation": bool((cols == c).all()), "phases": info["phases"],
                    "rounds": info["rounds"], "gap": info["gap"], "gap_bound": info["bound"]}
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(rec) -> str:
    lines = ["# Solvers: the device paths against the host's", "",
             f"Written by `python -m benchmarks.bench_solvers` at commit {rec['commit']}, {rec['when']}, on "
             f"{rec['device_name']} (torch {rec['torch']}, {rec['threads']} threads); best of {rec['repeat']} "
             "after a warm-up.", "",
             "## Polar factor (float32): Newton–Schulz (Chen–Chow scaling) against the SVD", "",
             "| n | matrix | steps | fallback | iterative | SVD | iterative − SVD64 | SVD32 − SVD64 | iterative − SVD32 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["polar"]:
        lines.append(f"| {r['n']} | {r['matrix']} | {r['iterations']} | {r['fallback']} | {r['iterative_s']:.3f} s | "
                     f"{r['svd_s']:.3f} s | {r['iterative_dev_from_svd64']:.1e} | {r['svd32_dev_from_svd64']:.1e} | "
                     f"{r['iterative_vs_svd32']:.1e} |")
    lines += ["", "Deviations: the largest entry-wise difference of the orthogonal factors.", "",
              "## Assignment (float64): auction (ε-scaling, int64 benefits) against SciPy", "",
              "| n | matrix | auction | SciPy | phases | rounds | objective − SciPy's | same permutation | certified gap (bound) |",
              "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rec["assign"]:
        if not r["certified"]:
            lines.append(f"| {r['n']} | {r['matrix']} | {r['auction_s']:.3f} s | {r['scipy_s']:.3f} s | – | – | "
                         "certificate failed | – | – |")
            continue
        lines.append(f"| {r['n']} | {r['matrix']} | {r['auction_s']:.3f} s | {r['scipy_s']:.3f} s | {r['phases']} | "
                     f"{r['rounds']} | {r['objective_diff']:.1e} | {r['same_permutation']} | "
                     f"{r['gap']:.1e} ({r['gap_bound']:.1e}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_solvers", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--polar", type=int, nargs="*", default=[256, 1024, 2048])
    ap.add_argument("--assign", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"
    rec = {"commit": git_state(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": str(device), "device_name": name, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "repeat": a.repeat,
           "polar": [r for n in a.polar for r in bench_polar(n, device, a.repeat)],
           "assign": [r for n in a.assign for r in bench_assign(n, device, a.repeat)]}
    write_result(a.out, ".solvers-", rec, markdown)
    print(markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

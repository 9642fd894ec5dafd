"""The solvers' device paths against the host's: the Newton–Schulz polar factor
(``symgraph.solve._polar``) against the SVD, and the assignment paths of ``symgraph.solve``
against SciPy's dense ``linear_sum_assignment``: time and agreement.

Polar factor, per size ``n``, of a Gaussian matrix, one with singular values log-spaced from 1 to
1/100 and ``product`` (``A Bᵀ`` of two random ``n × 2.7n`` matrices: the residual stream's
similarity of two unrelated models), made in float64 on ``--device``: the float32 iteration's
steps, fallbacks and time, the float64 iteration's and the float32 and float64 SVDs' times, and
the largest entry-wise deviations from the float64 SVD's ``U Vᵀ``.

Assignment, per size ``n`` and ``--kinds``: ``uniform`` (``rand``), ``noisy_perm`` (``P + 0.3·N(0,
1)``), ``mlp_random`` / ``mlp_planted`` (float32, as weight matching builds an MLP's similarity:
``Σ_k W_A^k W_B^kᵀ`` over three ``n × --width`` weights, B's rows ``ρ·A[π] + √(1−ρ²)·noise``,
``ρ = 0`` / ``√(2 ln n / (3·width))``, where row maxima stop finding ``π``), solved on the device
by the library's ``default`` path, ``sparse`` (top-``SPARSE_K`` candidates, LAPJVsp on the host)
and the ``auction`` (its certificate's gap), and last by ``scipy`` (float64, in a forked process;
the copy to the host timed apart). Objectives in float64 against the best found. A call stops
past ``--call-timeout`` (SciPy's past ``--dense-timeout``) and none starts past ``--budget``;
sizes below 4096: best of ``--repeat`` after a warm-up, larger: one call. ``results.json`` and
``report.md`` in ``--out`` are rewritten after every row.
"""
from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import platform
import signal
import time

import numpy as np
import torch

from .harness import sync
from .provenance import REPO_ROOT, git_state, table, write_result

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "solvers"
BIG = 4096  # from this size on: one timed call, no warm-up


class _Timeout(Exception):
    """A call stopped past its time."""


def _limited(f, seconds):
    """``f()``, stopped by an alarm past ``seconds`` (raises :class:`_Timeout`; None: no alarm)."""
    if seconds is None:
        return f()

    def on_alarm(*_):
        raise _Timeout(f"over {seconds:.1f} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        return f()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _best(f, repeat, device, warm=True, limit=None):
    """``(best seconds, result)`` of ``repeat`` calls of ``f`` (after a warm-up call if ``warm``)."""
    if warm:
        _limited(f, limit)
        sync(device)
    best, out = float("inf"), None
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        out = _limited(f, limit)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def _matrix(kind, n, device, g):
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, device=device)  # noqa: E731
    if kind == "gaussian":
        return randn(n, n)
    if kind == "product":
        m = int(2.6875 * n)  # 11008 / 4096
        return (randn(n, m) / math.sqrt(m)) @ (randn(n, m) / math.sqrt(m)).mT
    U, V = torch.linalg.qr(randn(n, n))[0], torch.linalg.qr(randn(n, n))[0]
    return (U * torch.logspace(0, -2, n, dtype=torch.float64, device=device)) @ V.mT


def _svd_factor(M):
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def bench_polar(n, device, repeat, rows):
    """The polar rows of size ``n``, appended to ``rows`` as each is measured."""
    from symgraph.solve._polar import polar
    g = torch.Generator(device=device).manual_seed(n)
    for kind in ("gaussian", "cond100", "product"):
        M64 = _matrix(kind, n, device, g)
        M = M64.float()
        t_svd64, ref = _best(lambda: _svd_factor(M64), repeat, device, n < BIG)
        t_it, (Q, info) = _best(lambda: polar(M), repeat, device, n < BIG)
        t_it64, (Q64, info64) = _best(lambda: polar(M64), repeat, device, n < BIG)
        t_svd, R = _best(lambda: _svd_factor(M), repeat, device, n < BIG)
        rows.append({"n": n, "matrix": kind, "dtype": "float32", "iterations": info["iterations"],
                     "fallback": info["fallback"], "residual": info["residual"],
                     "iterative_s": t_it, "svd_s": t_svd, "svd64_s": t_svd64, "iterative64_s": t_it64,
                     "iterative64_fallback": info64["fallback"],
                     "iterative_dev_from_svd64": float((Q.double() - ref).abs().max()),
                     "iterative64_dev_from_svd64": float((Q64 - ref).abs().max()),
                     "svd32_dev_from_svd64": float((R.double() - ref).abs().max()),
                     "iterative_vs_svd32": float((Q.double() - R.double()).abs().max())})
        print(rows[-1], flush=True)


def similarity(kind, n, device, width, seed=0):
    """``(S, planted permutation or None, extra)`` on ``device`` (see the module docstring)."""
    g = torch.Generator(device=device).manual_seed(seed + n + 7919 * len(kind))
    if kind == "uniform":
        return torch.rand(n, n, generator=g, dtype=torch.float64, device=device), None, {}
    perm = torch.randperm(n, generator=g, device=device)
    if kind == "noisy_perm":
        S = torch.eye(n, dtype=torch.float64, device=device)[perm]
        return S + 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64, device=device), perm, {}
    rho = 0.0 if kind == "mlp_random" else math.sqrt(2 * math.log(n) / (3 * width))
    S = torch.zeros(n, n, dtype=torch.float32, device=device)
    for _ in range(3):  # gate, up, down: each a unit's row (or column) of width entries
        A, N = (torch.randn(n, width, generator=g, device=device) / math.sqrt(width) for _ in range(2))
        B = torch.empty_like(A)
        B[perm] = rho * A + math.sqrt(1 - rho * rho) * N  # B's unit perm[i] is A's unit i
        S += A @ B.mT
        del A, N, B
    return S, (perm if rho else None), {"rho": rho, "width": width}


def _objective(S, cols):
    c = torch.as_tensor(cols, device=S.device).long()
    return float(S.gather(1, c[:, None]).double().sum())


def _dense_in_child(s: np.ndarray, timeout: float):
    """SciPy's dense assignment of the host array ``s`` in a forked process (SciPy only: no torch,
    no device): ``(cols, seconds)``, or raises :class:`_Timeout` (the child killed) past ``timeout``."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        from scipy.optimize import linear_sum_assignment
        t = time.perf_counter()
        _, c = linear_sum_assignment(s, maximize=True)
        send.send((c.astype(np.int64), time.perf_counter() - t))
    p = ctx.Process(target=child)
    p.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise _Timeout(f"over {timeout:.1f} s")
        return recv.recv()
    except EOFError:
        raise RuntimeError("the SciPy process ended without a result") from None
    finally:
        p.kill()
        p.join()


def _solvers():
    from symgraph.solve import _solvers as SV
    from symgraph.solve._auction import auction

    def default(S):
        r = SV.solve("perm", S, dense=False)
        return r.element.index.cpu().numpy(), {"status": r.status}

    def sparse(S):
        rows, cols, status = SV._sparse_assignment(S)
        if rows is None:
            return None, {"status": "no full matching among the candidates"}
        return cols, {"status": status, "k": SV.SPARSE_K}

    def auc(S):
        out = auction(S)
        if out is None:
            return None, {"status": "certificate failed"}
        _, cols, info = out
        return cols.cpu().numpy(), {"status": "certified", **{k: info[k] for k in ("phases", "rounds", "gap", "bound")}}
    return {"default": default, "sparse": sparse, "auction": auc}


def bench_assign_row(n, kind, S, planted, extra, device, repeat, limit):
    """The on-device solvers of one similarity (``dict`` row)."""
    row = {"n": n, "matrix": kind, "dtype": str(S.dtype)[6:], **extra, "solvers": {},
           "row_maxima_permutation": int(torch.unique(S.argmax(1)).numel()) == n}
    if planted is not None:
        row["planted_objective"] = _objective(S, planted)  # row i -> column perm[i]
    for name, f in _solvers().items():
        left = limit()
        if left <= 0:
            row["solvers"][name] = {"skipped": "budget spent"}
            continue
        try:
            t, (cols, info) = _best(lambda f=f: f(S), repeat, device, warm=n < BIG, limit=left)
        except _Timeout as e:
            row["solvers"][name] = {"timeout": str(e)}
            sync(device)
            print(f"  {kind} n={n} {name}: {e}", flush=True)
            continue
        rec = row["solvers"][name] = {"seconds": t, **info}
        if cols is not None:
            rec.update(objective=_objective(S, cols), permutation=bool(np.unique(np.asarray(cols)).size == n),
                       cols=np.asarray(cols))  # cols: dropped before writing
            if planted is not None:
                rec["planted_recovered"] = float((torch.as_tensor(cols, device=S.device) == planted).double().mean())
        print(f"  {kind} n={n} {name}: {t:.3f} s {info.get('status', '')}", flush=True)
    return row


def bench_dense_row(row, S, device, limit):
    """SciPy's dense solve of ``S`` added to ``row``."""
    left = limit()
    if left <= 0:
        row["solvers"]["scipy"] = {"skipped": "budget spent"}
        return
    sync(device)
    t = time.perf_counter()
    s = S.detach().double().cpu().numpy()
    copy = time.perf_counter() - t
    try:
        cols, secs = _dense_in_child(s, left)
    except _Timeout as e:
        row["solvers"]["scipy"] = {"timeout": str(e), "copy_s": copy}
        print(f"  {row['matrix']} n={row['n']} scipy: {e}", flush=True)
        return
    row["solvers"]["scipy"] = {"seconds": secs + copy, "solve_s": secs, "copy_s": copy, "status": "optimal",
                               "objective": float(s[np.arange(s.shape[0]), cols].sum()), "cols": cols}
    print(f"  {row['matrix']} n={row['n']} scipy: {secs:.3f} s (+ {copy:.3f} s copy)", flush=True)


def agree(row):
    """Each solver's objective against the best found, and permutations against SciPy's."""
    objs = [x["objective"] for x in row["solvers"].values() if "objective" in x]
    if not objs:
        return
    row["best_objective"] = best = max(objs)
    ref = row["solvers"].get("scipy", {}).get("cols")
    for x in (x for x in row["solvers"].values() if "objective" in x):
        x["objective_vs_best"] = x["objective"] - best
        if ref is not None and "cols" in x:
            x["same_as_scipy"] = bool((np.asarray(x["cols"]) == ref).all())


def verdicts(rows):
    """Per row, whether the auction was faster than the sparse solve."""
    out = []
    for r in rows:
        ta, ts = (x.get("seconds") if "objective" in x else None
                  for x in (r["solvers"].get("auction", {}), r["solvers"].get("sparse", {})))
        if ta is not None or ts is not None:
            out.append({"n": r["n"], "matrix": r["matrix"], "auction_s": ta, "sparse_s": ts,
                        "auction_faster": ta is not None and (ts is None or ta < ts)})
    return out


def _s(x, key="seconds"):
    if "seconds" in x and key in x:
        return f"{x[key]:.3f} s"
    return x.get("timeout") or x.get("skipped") or x.get("status") or "–"


def markdown(rec) -> str:
    lines = ["# Solvers: the device paths against the host's", "",
             f"Written by `python -m benchmarks.bench_solvers` at commit {rec['commit']}, {rec['when']}, on "
             f"{rec['device_name']} (torch {rec['torch']}, {rec['threads']} threads); sizes below {BIG}: best of "
             f"{rec['repeat']} after a warm-up, larger: one call. Budget {rec.get('budget')} s; "
             f"{'finished' if rec.get('done') else 'unfinished (rewritten after every row)'}.", "",
             "## Polar factor: Newton–Schulz (Chen–Chow scaling) against the SVD, on the device", ""]
    lines += table(["n", "matrix", "steps", "fallback", "iterative f32", "iterative f64", "SVD f32", "SVD f64",
                    "iterative − SVD64", "SVD32 − SVD64", "iterative64 − SVD64"],
                   [[r["n"], r["matrix"], r["iterations"], r["fallback"], f"{r['iterative_s']:.3f} s",
                     f"{r['iterative64_s']:.3f} s", f"{r['svd_s']:.3f} s", f"{r['svd64_s']:.3f} s",
                     f"{r['iterative_dev_from_svd64']:.1e}", f"{r['svd32_dev_from_svd64']:.1e}",
                     f"{r['iterative64_dev_from_svd64']:.1e}"] for r in rec["polar"]],
                   ["r", None] + ["r"] * 9)
    lines += ["", "Deviations: the largest entry-wise difference of the orthogonal factors.", "",
              "## Assignment: the library's default path, sparse top-k, device auction, dense SciPy", ""]
    rows = []
    for r in rec["assign"]:
        d, sp, au, sc = (r["solvers"].get(k, {}) for k in ("default", "sparse", "auction", "scipy"))
        diffs = " / ".join(f"{x['objective_vs_best']:.1e}" if "objective_vs_best" in x else "–"
                           for x in (d, sp, au, sc))
        found = max((x.get("planted_recovered", -1) for x in r["solvers"].values()), default=-1)
        rows.append([r["n"], r["matrix"], r["row_maxima_permutation"], f"{_s(d)} ({d.get('status', '–')})", _s(sp),
                     _s(au) + (f" ({au['phases']}, {au['rounds']})" if "rounds" in au else ""),
                     _s(sc) + (f" ({sc['copy_s']:.2f} s)" if "copy_s" in sc and "seconds" in sc else ""), diffs,
                     "–" if found < 0 else f"{found:.3f}"])
    lines += table(["n", "matrix", "row maxima a perm.", "default (status)", "sparse top-k",
                    "auction (phases, rounds)", "SciPy dense (copy)",
                    "objective − best: default / sparse / auction / SciPy", "planted recovered"],
                   rows, ["r", None, None, None, "r", "r", "r", None, "r"])
    if rec.get("auction_vs_sparse"):
        lines += ["", "Auction faster than the sparse solve: " + ", ".join(
            f"n={v['n']} {v['matrix']}: {v['auction_faster']}" for v in rec["auction_vs_sparse"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_solvers", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--polar", type=int, nargs="*", default=[256, 1024, 2048])
    ap.add_argument("--assign", type=int, nargs="*", default=[256, 1024])
    kinds = ["uniform", "noisy_perm", "mlp_random", "mlp_planted"]
    ap.add_argument("--kinds", nargs="*", default=kinds, choices=kinds)
    ap.add_argument("--width", type=int, default=4096, help="the mlp kinds' weight width (the hidden size)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--budget", type=float, default=None, help="no call starts after this many seconds")
    ap.add_argument("--call-timeout", type=float, default=120.0, help="each call stopped past this")
    ap.add_argument("--dense-timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_solvers: --device cuda but this machine has no CUDA device")
        return 2
    t0 = time.perf_counter()

    def limit(cap=a.call_timeout):
        return min(cap, math.inf if a.budget is None else a.budget - (time.perf_counter() - t0))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"
    rec = {"commit": os.environ.get("SYMGRAPH_COMMIT") or git_state(), "device": str(device), "device_name": name,
           "when": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "repeat": a.repeat, "budget": a.budget, "polar": [], "assign": [],
           "done": False}
    rows: list = []

    def save():  # the solvers' columns kept for agree() only
        rec["assign"] = [r | {"solvers": {k: {a: b for a, b in v.items() if a != "cols"}
                                          for k, v in r["solvers"].items()}} for r in rows]
        rec["auction_vs_sparse"] = verdicts(rows)
        write_result(a.out, ".solvers-", rec, markdown)
    for n in a.polar:
        if limit() <= 0:
            break
        try:
            _limited(lambda: bench_polar(n, device, a.repeat, rec["polar"]), limit())
        except _Timeout as e:
            print(f"  polar n={n}: {e}", flush=True)
        save()
    for n in a.assign:
        for kind in a.kinds:
            if limit() <= 0:
                break
            S, planted, extra = similarity(kind, n, device, a.width)
            row = bench_assign_row(n, kind, S, planted, extra, device, a.repeat, limit)
            rows.append(row)
            agree(row)
            save()
            bench_dense_row(row, S, device, lambda: limit(a.dense_timeout))
            agree(row)
            save()
            del S
    rec["done"] = True
    rec["seconds"] = time.perf_counter() - t0
    save()
    print(markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

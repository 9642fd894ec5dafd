"""What the speed settings of weight matching cost in quality: the suite's trained pairs aligned
with each setting, the barrier (11-point curve, quick protocol's 4 held-out batches) and the
number of sweeps, against the exact reference (sweeps until no element changes, ``tol=0``,
exact products, no sketch, up to 6 sweeps).

    python -m benchmarks.bench_sweeps [--archs gpt2 llama bert vit] [--size quick]
                                      [--out benchmarks/results/speed_quality/sweeps.json]

Settings: ``until="discrete"`` (from the second sweep on, the loop ends once a sweep changes
no permutation or head matching), ``until="gap"`` (the default: ... and none of its solves closes
5% of its unit's gap to the Cauchy–Schwarz bound), ``max_iter=k`` (the loop stops after k sweeps),
``defer=False`` (every unit whose inputs changed re-solved in every sweep, as before
deferral), ``head_cost="circuits"`` and ``block_scale="columns"`` (Theus et al. 2025's head
cost and block scaling), ``tol`` (a unit keeps its element unless a re-solve gains more than that fraction
of its objective), ``similarity="bf16"`` (products in bfloat16), ``sketch=k`` (a k-column
projection, k a quarter of the model width so that it applies at these sizes), and a bf16
checkpoint's case: the pair cast to bfloat16 and aligned with float32 products (``bf16 weights,
exact``) or with bfloat16 products (the CPU kernels accumulate in float32 and round each result
to bfloat16), each alignment applied to the float32 B, the second compared with the first.
Reported per
architecture: each pair's barrier and sweeps, the mean, and the pair-to-pair standard
deviation of the exact reference (the issue's yardstick: a setting is "unchanged" when every
pair's barrier is within that spread of the reference).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import numpy as np
import torch

import symgraph

from . import evaluate, train
from .provenance import command_line, git_state, table, write_beside

LAMBDAS = np.linspace(0.0, 1.0, 11)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "speed_quality" / "sweeps.json"


#: The exact reference: sweeps until no element changes (``until="exact"``,
#: ``tol=0``), exact products, at most this many sweeps.
EXACT_SWEEPS = 6
EXACT = "exact (until=exact, tol=0)"


def settings(width: int) -> dict:
    """Each setting as what it changes from the exact reference (``until="exact"``, ``tol=0``,
    exact products, at most :data:`EXACT_SWEEPS` sweeps)."""
    base = dict(until="exact", tol=0.0, similarity="exact", max_iter=EXACT_SWEEPS)
    rows = {EXACT: {},
            "tol=1e-4": dict(tol=1e-4),
            "tol=1e-3": dict(tol=1e-3),
            "tol=1e-2": dict(tol=1e-2),
            # from the second sweep on, stop once no discrete element changes
            "until=discrete": dict(until="discrete"),
            # ... and no solve closes 5% of its unit's gap to the Cauchy–Schwarz bound (the default)
            "until=gap": dict(until="gap"),
            # fewer sweeps: the loop stops after this many, converged or not
            "max_iter=2": dict(max_iter=2),
            "max_iter=3": dict(max_iter=3),
            "max_iter=4": dict(max_iter=4),
            "bf16 products": dict(similarity="bf16"),
            f"sketch={max(width // 4, 4)}": dict(sketch=max(width // 4, 4)),
            "no deferral": dict(defer=False),
            "head_cost=circuits": dict(head_cost="circuits"),
            "block_scale=columns": dict(block_scale="columns"),
            # a bf16 checkpoint's case: the pair cast to bfloat16, aligned, the alignment applied
            # to the float32 B (so that only the alignment differs); bf16 products against
            # float32 products of the same bf16 weights
            "bf16 weights, exact": dict(cast=torch.bfloat16),
            "bf16 weights, bf16 products": dict(cast=torch.bfloat16, similarity="bf16")}
    return {name: base | kw for name, kw in rows.items()}


REFERENCE = {"bf16 weights, bf16 products": "bf16 weights, exact"}  # default: EXACT


def run(archs, size="quick", seeds=(0, 1, 2), max_batches=4, only=None) -> dict:
    out = {}
    for arch in archs:
        models = {s: train.train_model(arch, s, size=size) for s in seeds}
        loss = evaluate.loss_fn_for(arch, max_batches=max_batches)
        width = getattr(models[seeds[0]].config, "hidden_size", None) or models[seeds[0]].config.n_embd
        rows = {}
        for name, kw in settings(width).items():
            if only and name not in only and name != EXACT and name not in {
                    REFERENCE.get(o) for o in only}:
                continue
            per = []
            for a, b in itertools.combinations(seeds, 2):
                A, B = models[a], models[b]
                kw = dict(kw)
                cast = kw.pop("cast", None)
                t0 = time.perf_counter()
                if cast is None:
                    al = symgraph.align(A, B, **kw)
                else:
                    al = symgraph.align(copy.deepcopy(A).to(cast), copy.deepcopy(B).to(cast), **kw)
                secs = time.perf_counter() - t0
                bar = symgraph.loss_barrier(symgraph.interpolate(A, al.apply(B), LAMBDAS, loss))
                per.append({"pair": [a, b], "barrier": bar, "sweeps": al.seconds.get("sweeps"), "align_seconds": secs})
                print(f"{arch:6s} {a}-{b} {name:20s} barrier {bar:.4f} sweeps {al.seconds.get('sweeps')} "
                      f"{secs:.2f} s", flush=True)
            rows[name] = {"pairs": per, "mean": float(np.mean([p["barrier"] for p in per]))}
        spread = float(np.std([p["barrier"] for p in rows[EXACT]["pairs"]], ddof=1))
        for name, r in rows.items():
            r["reference"] = REFERENCE.get(name, EXACT) if REFERENCE.get(name) in rows else EXACT
            ref = [p["barrier"] for p in rows[r["reference"]]["pairs"]]
            r["max_abs_diff_to_exact"] = float(max(abs(p["barrier"] - q) for p, q in zip(r["pairs"], ref)))
            r["within_spread"] = r["max_abs_diff_to_exact"] <= spread
        out[arch] = {"width": width, "exact_pair_std": spread, "settings": rows}
    return out


def markdown(res: dict, run: dict | None = None) -> str:
    run = run or {}
    lines = ["# Weight matching: speed settings against the exact reference (suite pairs)", "",
             f"Written by `{run.get('command', 'python -m benchmarks.bench_sweeps')}` at symgraph "
             f"{run.get('commit', '?')} ({run.get('time', '?')}). Barrier: mean over the 3 pairs; "
             "Δ: largest |barrier − reference| over the pairs (the exact setting; for bf16 products of "
             "bf16 weights, the exact products of the same bf16 weights); spread: the exact barriers' pair-to-pair "
             "standard deviation; sweeps: per pair.", ""]
    lines += table(["arch", "setting", "mean barrier", "Δ to reference", "spread", "within", "sweeps"],
                   [[arch, name, f"{r['mean']:.3f}", f"{r['max_abs_diff_to_exact']:.3f}", f"{a['exact_pair_std']:.3f}",
                     "yes" if r["within_spread"] else "no", ", ".join(str(p["sweeps"]) for p in r["pairs"])]
                    for arch, a in res.items() for name, r in a["settings"].items()],
                   [None, None, "r", "r", "r", None, None])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_sweeps", description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=["gpt2", "llama", "bert", "vit"])
    ap.add_argument("--size", default="quick")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--settings", nargs="+", default=None,
                    help="run only these settings (names as in the table; the exact reference always runs)")
    a = ap.parse_args(argv)
    res = run(a.archs, a.size, only=a.settings)
    meta = {"command": command_line(argv, module="benchmarks.bench_sweeps"), "commit": git_state(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_beside(a.out, {"run": meta, **res}, markdown(res, meta), meta["command"])
    print(markdown(res, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the speed settings of weight matching cost in quality: the suite's trained pairs aligned
with each setting (:func:`settings`), the barrier (11-point curve, the quick protocol's 4
held-out batches) and the sweeps, against the exact reference (sweeps until no element changes,
``tol=0``, exact products, no sketch, up to 6 sweeps); ``bf16 weights, bf16 products`` against
``bf16 weights, exact`` (the pair cast to bfloat16, each alignment applied to the float32 B).
Reported per architecture: each pair's barrier and sweeps, the mean, and the exact reference's
pair-to-pair standard deviation (a setting is "within" when every pair's barrier is within that
spread of its reference).

    python -m benchmarks.bench_sweeps [--archs gpt2 llama bert vit] [--size quick] [--settings NAME ...]
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
EXACT_SWEEPS = 6  # the exact reference's most sweeps
EXACT = "exact (until=exact, tol=0)"
REFERENCE = {"bf16 weights, bf16 products": "bf16 weights, exact"}  # default: EXACT


def settings(width: int) -> dict:
    """Each setting's ``symgraph.align`` keywords (``cast``: the pair's dtype): the exact reference's
    with what the setting changes: when the sweeps end (``until``: once no discrete element changes,
    or also no solve closes 5% of its unit's gap to the bound; ``max_iter``), ``tol`` (a unit keeps
    its element unless a re-solve gains more than that fraction of its objective), bfloat16
    products, a sketch of a quarter of the width, no deferral, Theus et al. 2025's head cost and
    block scaling, and the pair cast to bfloat16."""
    k = max(width // 4, 4)
    rows = {EXACT: {}, "tol=1e-4": dict(tol=1e-4), "tol=1e-3": dict(tol=1e-3), "tol=1e-2": dict(tol=1e-2),
            "until=discrete": dict(until="discrete"), "until=gap": dict(until="gap"),
            "max_iter=2": dict(max_iter=2), "max_iter=3": dict(max_iter=3), "max_iter=4": dict(max_iter=4),
            "bf16 products": dict(similarity="bf16"), f"sketch={k}": dict(sketch=k), "no deferral": dict(defer=False),
            "head_cost=circuits": dict(head_cost="circuits"), "block_scale=columns": dict(block_scale="columns"),
            "bf16 weights, exact": dict(cast=torch.bfloat16),
            "bf16 weights, bf16 products": dict(cast=torch.bfloat16, similarity="bf16")}
    return {name: dict(until="exact", tol=0.0, similarity="exact", max_iter=EXACT_SWEEPS) | kw
            for name, kw in rows.items()}


def run(archs, size="quick", seeds=(0, 1, 2), max_batches=4, only=None) -> dict:
    out = {}
    for arch in archs:
        models = {s: train.train_model(arch, s, size=size) for s in seeds}
        loss = evaluate.loss_fn_for(arch, max_batches=max_batches)
        width = getattr(models[seeds[0]].config, "hidden_size", None) or models[seeds[0]].config.n_embd
        wanted = None if not only else {*only, EXACT, *(REFERENCE.get(o) for o in only)}
        rows = {}
        for name, kw in settings(width).items():
            if wanted and name not in wanted:
                continue
            per, cast = [], kw.pop("cast", None)
            for a, b in itertools.combinations(seeds, 2):
                A, B = models[a], models[b]
                t0 = time.perf_counter()
                pair = (A, B) if cast is None else (copy.deepcopy(A).to(cast), copy.deepcopy(B).to(cast))
                al = symgraph.align(*pair, **kw)
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

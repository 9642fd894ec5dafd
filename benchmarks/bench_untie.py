"""Benchmark: the untied merge of tied GPT-2 pairs (Theus et al. 2025 untie GPT-2's head so the
residual stream admits orthogonal maps). For each seed pair of the suite's cached GPT-2s
(trained tied), the loss barrier on the suite's held-out batches (11-point λ grid) of vanilla
averaging, weight matching in the tied model (residual stream: permutations) and weight
matching after :func:`symgraph.core.ties.untie` (residual stream: O(d) fixing 𝟙).

``python -m benchmarks.bench_untie [--size quick] [--seeds 0 1 2] [--out DIR]``
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

import symgraph
from symgraph.core.ties import untie

from . import evaluate, train
from .provenance import write_beside

LAMBDAS = np.linspace(0, 1, 11)
KINDS = ("vanilla", "weights_tied", "weights_untied")


def run(size: str, seeds, max_batches) -> dict:
    models = {s: train.train_model("gpt2", s, size=size) for s in seeds}
    loss = evaluate.loss_fn_for("gpt2", max_batches=max_batches)
    barrier = lambda A, B: symgraph.loss_barrier(symgraph.interpolate(A, B, LAMBDAS, loss))  # noqa: E731
    rows = []
    for a, b in itertools.combinations(seeds, 2):
        A, B = models[a], models[b]
        t0 = time.perf_counter()
        Au, Bu = untie(A), untie(B)
        row = {"pair": [a, b], "vanilla": barrier(A, B), "weights_tied": barrier(A, symgraph.align(A, B).apply(B)),
               "weights_untied": barrier(Au, symgraph.align(Au, Bu).apply(Bu)), "seconds": time.perf_counter() - t0}
        print(json.dumps(row), flush=True)
        rows.append(row)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in KINDS}
    return {"size": size, "seeds": list(seeds), "max_batches": max_batches, "rows": rows, "mean": mean,
            "ratio_untied": mean["weights_untied"] / mean["vanilla"],
            "ratio_tied": mean["weights_tied"] / mean["vanilla"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_untie", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="quick")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-batches", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "untied"))
    a = ap.parse_args(argv)
    res = run(a.size, a.seeds, a.max_batches)
    write_beside(Path(a.out) / f"untie_merge_{a.size}.json", res)
    m = res["mean"]
    print(f"mean barrier: vanilla {m['vanilla']:.3f}, weights (tied) {m['weights_tied']:.3f} "
          f"({res['ratio_tied']:.2f}x), weights (untied merge) {m['weights_untied']:.3f} ({res['ratio_untied']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight matching of a random bf16 LLaMA pair (built in memory as benchmarks/scale writes it:
unrelated models, so every MLP needs its assignment) with the sweeps' independent host
assignment solves one after the other and overlapping (:data:`symgraph.solve.turns.THREADS`,
``--threads``), alternating, in one process; checks that each gives the same alignment.
``--mlp-only``: the MLPs' classes alone (one wave of independent units). Printed: the seconds of
the coordinate descent (``Sweeps.run``) and of the whole ``align`` call (the solvers' own), the
sweeps, and each setting's best time against the first setting's.
"""
from __future__ import annotations

import argparse
import time
from unittest import mock

import torch


def build(shape: str, layers: int, seed: int):
    from transformers import LlamaForCausalLM

    from .scale.checkpoints import llama_config, make_tensor
    model = LlamaForCausalLM(llama_config(shape, layers)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(make_tensor(name, tuple(p.shape), seed))
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mlp-only", action="store_true")
    args = ap.parse_args(argv)
    import symgraph
    from symgraph.alignment.sweeps import Sweeps
    from symgraph.core.elements import Perm
    from symgraph.solve import turns
    inner, swept = Sweeps.run, []

    def timed(self, sweeps):  # the coordinate descent alone (not the folding before it)
        t = time.perf_counter()
        try:
            return inner(self, sweeps)
        finally:
            swept.append(time.perf_counter() - t)
    A, B = build(args.shape, args.layers, 0), build(args.shape, args.layers, 1)
    ra, rb = symgraph.analyze(A), symgraph.analyze(B)
    kw = {"groups": (lambda g: g.dim == A.config.intermediate_size)} if args.mlp_only else {}
    settings = [int(x) for x in args.threads.split(",")]
    times: dict = {k: [] for k in settings}
    first = None
    for _ in range(args.repeats):
        for k in settings:
            turns.THREADS = k
            t = time.perf_counter()
            with mock.patch.object(Sweeps, "run", timed):
                al = symgraph.align(A, B, report_a=ra, report_b=rb, **kw)
            wall = time.perf_counter() - t
            els = {g: (e.index if isinstance(e, Perm) else e) for g, e in al.elements.items()}
            objs = {g: r.objective for g, r in al.results.items()}
            first = first or (els, objs, al.seconds["sweeps"])
            same = (first[2] == al.seconds["sweeps"] and first[1] == objs and first[0].keys() == els.keys()
                    and all(torch.equal(first[0][g], els[g]) for g in els))
            times[k].append((swept[-1], wall))
            print(f"threads={k}: sweeps {swept[-1]:.2f} s, align {wall:.2f} s (solvers "
                  f"{al.seconds['solver']:.2f} s), {al.seconds['sweeps']} sweeps, same alignment: {same}", flush=True)
    best = {k: min(v) for k, v in times.items()}
    for k in settings:
        print(f"threads={k}: best sweeps {best[k][0]:.2f} s ({best[settings[0]][0] / best[k][0]:.2f}x "
              f"threads={settings[0]}), align {best[k][1]:.2f} s ({best[settings[0]][1] / best[k][1]:.2f}x)")
    return best


if __name__ == "__main__":
    main()

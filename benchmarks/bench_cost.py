"""Cost model of out-of-core alignment: for each stage of ``symgraph merge --align weights`` on
a LLaMA-shaped bf16 pair, its FLOPs and bytes, its time, and the achieved GFLOP/s and GB/s next
to the machine's measured matmul peak and read throughput in the same run.

The pair is :mod:`benchmarks.bench_scale`'s (same writer, same cache under ``--work``). The
merge runs in this process with the library's stage functions wrapped (a counting shim, nothing
else changes); every call is timed and its work counted:

* ``similarity``: ``alignment.weights.cross``, ``2·F·n_A·n_B·m`` FLOPs for ``[F, n, m]`` features
  (the Gram products Σ W_A W_Bᵀ), in the dtype the products run in;
* ``apply maps``: dense ``alignment.weights.apply_along`` (B's other axes into A's basis),
  ``2·n·n·rest`` FLOPs; head maps applied block by block (``Blocks``: a permutation of heads
  with a matrix per head) ``2·H·b²·rest``; gathers (permutations) count their bytes;
* ``procrustes``: ``torch.linalg.svd`` of ``n×n``, counted as 22·n³ (Golub & Van Loan's count
  for U, Σ and V by R-SVD);
* ``assignment``: ``solve.hungarian`` by how it ended (dense Jonker–Volgenant, sparse top-k
  candidates, row maxima), reported as time (its cost is not FLOP-bound; counted as n³ for a
  reference rate);
* ``unit solve``: ``solve.nested_heads`` / ``inner_blocks`` / ``solve`` as the sweep calls them
  (time only, inclusive of the SVDs and assignments inside: where the solver time goes by kind);
* ``read``: checkpoint tensor reads (bytes), against the measured page-cache read throughput;
* ``fold``: norm gains folded into readers; ``write``: the whole write phase (bytes written).

Peaks are measured first: ``torch.mm`` of 4096² in float32 and bfloat16 (best of 3), SVD of a
2048² float64 and float32 matrix, and reading model A's files from the page cache. Results go to
``--out`` (JSON, one entry per ``--label``, kept across runs) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import collections
import math
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from .provenance import best_time, commit_info, matmul_gflops, table, write_entry

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cost" / "cost.json"


def peaks(files) -> dict:
    """The machine's measured rates, in this process (same threads as the merge)."""
    out = {f"mm_{k}_gflops": v for k, v in matmul_gflops((torch.float32, torch.bfloat16, torch.float64)).items()}
    for dt in (torch.float64, torch.float32):
        s = torch.randn(2048, 2048, dtype=dt)
        out[f"svd_{str(dt)[6:]}_gflops"] = 22 * 2048 ** 3 / best_time(lambda: torch.linalg.svd(s, full_matrices=False), 1) / 1e9
    total, t = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    out["read_gbs"] = total / (time.perf_counter() - t) / 1e9
    return out


class Counter:
    """Wraps the stage functions; ``rows`` maps stage -> [calls, seconds, flops, bytes, dtypes]."""

    def __init__(self, sync=None):
        self.rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, set()])
        self._undo = []
        self._sync = sync or (lambda: None)  # an accelerator's synchronize: each stage's own time

    def wrap(self, owner, name, stage, cost):
        f = getattr(owner, name)

        def shim(*a, **k):
            self._sync()
            t = time.perf_counter()
            r = f(*a, **k)
            self._sync()
            dt = time.perf_counter() - t
            st, flops, nbytes, dtype = cost(r, *a, **k)
            st = st or stage
            row = self.rows[f"{st}, {dtype}" if dtype and flops else st]
            row[0] += 1
            row[1] += dt
            row[2] += flops
            row[3] += nbytes
            if dtype:
                row[4].add(dtype)
            return r
        setattr(owner, name, shim)
        self._undo.append((owner, name, f))

    def undo(self):
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)


def _cross_cost(r, xa, xb, nf, cross_fibres):
    F, Fb = math.prod(xa.shape[:nf]), math.prod(xb.shape[:nf])
    n, m, nb = xa.shape[-2], xa.shape[-1], xb.shape[-2]
    pairs = F * Fb if (nf and cross_fibres) else F
    return None, 2.0 * pairs * n * nb * m, 0.0, str(xa.dtype)[6:]


def _apply_cost(r, t, d, M):
    from symgraph.core.elements import Blocks, is_perm
    if isinstance(M, Blocks):  # per head: H·b² per column
        H, b = M.blocks.shape[:2]
        return "apply maps (blocks)", 2.0 * H * b * b * (t.numel() // t.shape[d]), 0.0, str(t.dtype)[6:]
    if M.dim() == 1 or (not M.requires_grad and is_perm(M)):  # as apply_along decides
        return "apply maps (gather)", 0.0, 2.0 * t.numel() * t.element_size(), str(t.dtype)[6:]
    rest = t.numel() // t.shape[d]
    return "apply maps (dense)", 2.0 * M.shape[0] * M.shape[1] * rest, 0.0, str(t.dtype)[6:]


def instrument(sync=None) -> Counter:
    from symgraph.alignment import weights as W
    from symgraph.solve import _solvers as SV
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.transform import folding
    from symgraph.merging.streaming import StreamingMerge
    c = Counter(sync)
    c.wrap(W, "cross", "similarity", _cross_cost)
    c.wrap(W, "apply_along", "apply maps", _apply_cost)
    c.wrap(torch.linalg, "svd", "procrustes",
           lambda r, s, *a, **k: (None, 22.0 * s.shape[-1] ** 3 * (s.numel() // s.shape[-1] ** 2), 0.0,
                                  str(s.dtype)[6:]))
    c.wrap(SV, "hungarian", "assignment",
           lambda r, s, *a, **k: (f"assignment ({r.status.split(' (')[0]})", float(min(s.shape)) ** 3, 0.0, None))
    c.wrap(Checkpoint, "read", "read", lambda r, *a, **k: (None, 0.0, float(r.numel() * r.element_size()),
                                                           str(r.dtype)[6:]))
    c.wrap(folding, "fold", "fold", lambda r, *a, **k: (None, 0.0, 0.0, None))
    import symgraph.solve as solve_pkg  # whole unit solves as the sweep calls them (time only,
    timed = lambda r, *a, **k: (None, 0.0, 0.0, None)  # noqa: E731  inclusive of SVDs and assignments)
    c.wrap(solve_pkg, "nested_heads", "unit solve: heads (nested)", timed)
    c.wrap(solve_pkg, "inner_blocks", "unit solve: inner blocks", timed)
    c.wrap(solve_pkg, "solve", "unit solve", lambda r, kind, *a, **k: (f"unit solve: {kind}", 0.0, 0.0, None))
    c.wrap(StreamingMerge, "write", "write (whole phase)", lambda r, *a, **k: (None, 0.0, 0.0, None))
    from symgraph.report.symmetry import SymmetryReport
    c.wrap(SymmetryReport, "axis_map", "axis maps built", timed)  # time only (inside similarity and write)
    _instrument_activations(c)
    return c


def _instrument_activations(c: Counter):
    """``--align activations``: the statistics phase as one stage whose FLOPs are the two graphs'
    forward ops (PyTorch's ``FlopCounterMode`` around each ``Stepper.run_node``: every matmul
    of the graphs as it runs) plus the cross-moments (``ActStats.add``: ``2·t·F_A·F_B·n_A·n_B``
    for the cross sums, in the dtype they run in, however the library computes them), and the
    graph ops run against one run of both graphs over every batch (the ops of the analysis
    graph × batches × 2)."""
    from torch.utils.flop_counter import FlopCounterMode
    from symgraph.alignment import activations as ACT
    from symgraph.alignment import driver as D
    from symgraph.alignment import graphrun as G

    graph = {"flops": 0.0, "moments": 0.0}  # counted so far: forward ops, cross-moments
    run_node = G.Stepper.run_node

    def counted_node(self, *a, **k):
        with FlopCounterMode(display=False) as fc:
            out = run_node(self, *a, **k)
        graph["flops"] += fc.get_total_flops()
        return out
    c._undo.append((G.Stepper, "run_node", run_node))
    G.Stepper.run_node = counted_node
    c.wrap(G.Stepper, "run_node", "graph ops run", lambda r, *a, **k: (None, 0.0, 0.0, None))

    def moments(r, self, xa, xb, nf, work=torch.float64):
        t, fa, fb = xa.shape[0], (math.prod(xa.shape[1:-1]) if nf else 1), (math.prod(xb.shape[1:-1]) if nf else 1)
        flops = 2.0 * t * fa * fb * xa.shape[-1] * xb.shape[-1]
        graph["moments"] += flops
        return None, flops, 0.0, str(work)[6:]
    c.wrap(ACT.ActStats, "add", "cross-moments", moments)

    f = D.activation_similarity

    def phase(ra, rb, data, *a, **k):
        before = sum(graph.values())
        out = f(ra, rb, data, *a, **k)
        c.rows["graph ops, one run of both graphs over the data"][0] += 2 * len(data) * len(ra.nodes())
        phase.flops = sum(graph.values()) - before
        return out
    c._undo.append((D, "activation_similarity", f))
    D.activation_similarity = phase
    c.wrap(D, "activation_similarity", "activation statistics (whole phase)",
           lambda r, *a, **k: (None, float(phase.flops), 0.0, None))


def stage_rows(c: Counter, pk: dict) -> dict:
    """Each counted stage: calls, seconds, GFLOP, GB, achieved rates and the fraction of the
    measured peak of its dtype (``pk``: :func:`peaks`' keys; ``read_gbs`` may be absent)."""
    rows = {}
    for stage, (n, sec, fl, nb, dts) in c.rows.items():
        dt = ",".join(sorted(dts))
        peak = {"bfloat16": pk["mm_bfloat16_gflops"], "float64": pk.get("mm_float64_gflops", pk["mm_float32_gflops"])
                }.get(dt, pk["mm_float32_gflops"])
        if stage.startswith("procrustes"):
            peak = pk["svd_float64_gflops"] if "float64" in dt else pk["svd_float32_gflops"]
        read = pk.get("read_gbs")
        rows[stage] = {"calls": n, "seconds": sec, "gflop": fl / 1e9, "gb": nb / 1e9, "dtype": dt,
                       "gflops": fl / 1e9 / sec if sec and fl else None,
                       "of_peak": (fl / 1e9 / sec / peak) if sec and fl and not stage.startswith("assignment") else None,
                       "gbs": nb / 1e9 / sec if sec and nb else None,
                       "of_read_peak": (nb / 1e9 / sec / read) if sec and nb and read and stage.startswith("read") else None}
    return rows


def run(shape="1b", layers=2, work="/tmp/symgraph-scale", align="weights", extra=()) -> dict:
    from benchmarks.scale.checkpoints import ensure_pair
    pair = ensure_pair(Path(work), shape, layers)
    a, b = pair["a"], pair["b"]
    files = sorted(str(p) for p in Path(a).glob("*.safetensors"))
    pk = peaks(files)
    out = Path(work) / f"cost-out-{shape}-L{layers}"
    shutil.rmtree(out, ignore_errors=True)
    if align == "activations":  # bench_scale's data: DATA_ROWS random rows of DATA_TOKENS ids
        from benchmarks.scale.common import SHAPES
        from benchmarks.scale.stages import token_data
        extra = [*extra, "--data", token_data(pair["dir"], SHAPES[shape].get("vocab_size", 32000))]
    from symgraph.cli.main import main as cli
    c = instrument()
    t0 = time.perf_counter()
    try:
        rc = cli(["merge", a, b, "--out", str(out), "--align", align, *extra])
    finally:
        c.undo()
    wall = time.perf_counter() - t0
    try:  # the sweeps weight matching ran, from the merge's own record
        meta = json.loads((out / "symgraph_merge.json").read_text())
        sweeps = [a.get("seconds", {}).get("sweeps") for a in meta.get("alignments", [])]
    except (OSError, ValueError):
        sweeps = None
    shutil.rmtree(out, ignore_errors=True)
    rows = stage_rows(c, pk)
    return {"shape": shape, "layers": layers, "align": align, "options": list(extra), "rc": rc, "wall_seconds": wall, "sweeps": sweeps, "peaks": pk,
            "stages": rows, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": (commit_info()["commit"] or "?")[:7]}


def markdown(results: dict) -> str:
    lines = ["# Cost model: `symgraph merge --align weights|activations` by stage", "",
             "Written by `python -m benchmarks.bench_cost` (see its docstring). Time is inclusive "
             "per stage (a stage called inside another, e.g. a read inside a fold, is counted in both); "
             "`of peak` is achieved GFLOP/s over the same run's measured rate for that dtype "
             "(matmul 4096², SVD 2048²), `of read peak` GB/s over the page-cache read rate.", ""]
    for label, r in results.items():
        pk = r["peaks"]
        opts = " ".join(r.get("options") or []) or "default options"
        lines += [f"## {label}: {r['shape']}, {r['layers']} layers, {opts}, commit {r['commit']}, {r['when']}", "",
                  f"Wall {r['wall_seconds']:.1f} s (rc {r['rc']}), {r['threads']} threads. Peaks: matmul "
                  f"fp32 {pk['mm_float32_gflops']:.0f} GFLOP/s, bf16 {pk['mm_bfloat16_gflops']:.0f} GFLOP/s; "
                  f"SVD fp64 {pk['svd_float64_gflops']:.0f}, fp32 {pk['svd_float32_gflops']:.0f} GFLOP/s; "
                  f"read {pk['read_gbs']:.2f} GB/s."
                  + (f" Sweeps run: {', '.join(map(str, r['sweeps']))}." if r.get("sweeps") else ""), "",
                  _at_peak(r), ""]
        f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
        lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "GB", "GB/s", "dtype"],
                       [[st, x["calls"], f"{x['seconds']:.1f}", f(x["gflop"] or None, ".0f"), f(x["gflops"], ".0f"),
                         f(x["of_peak"] if x["of_peak"] is not None else x.get("of_read_peak"), ".0%"),
                         f(x["gb"] or None, ".2f"), f(x["gbs"], ".2f"), x["dtype"]]
                        for st, x in sorted(r["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                       [None] + ["r"] * 7 + [None]) + [""]
    return "\n".join(lines)


def _at_peak(r) -> str:
    """The run's counted work at the measured peaks (matmuls at that dtype's rate, SVDs at
    theirs, reads at the page-cache rate; assignment and the write phase as measured): how long
    the same work would take at the hardware's rate, against the wall time."""
    pk, t, measured = r["peaks"], 0.0, 0.0
    for st, x in r["stages"].items():
        if st.startswith(("similarity", "apply maps (dense)", "apply maps (blocks)", "procrustes")) and x["gflop"]:
            rate = (pk["svd_float64_gflops"] if "float64" in x["dtype"] else pk["svd_float32_gflops"]) \
                if st.startswith("procrustes") else (
                pk["mm_bfloat16_gflops"] if x["dtype"] == "bfloat16" else pk["mm_float32_gflops"])
            t += x["gflop"] / rate
        elif st == "read" and x["gb"]:
            t += x["gb"] / pk["read_gbs"]
        elif st.startswith("assignment") or st.startswith("write"):
            measured += x["seconds"]
    act = r["stages"].get("activation statistics (whole phase)")
    if act and act["gflop"]:
        mm = {"float32": pk["mm_float32_gflops"], "bfloat16": pk["mm_bfloat16_gflops"],
              "float64": pk.get("mm_float64_gflops", pk["mm_float32_gflops"] / 2)}
        mom = {st.split(", ")[1]: x["gflop"] for st, x in r["stages"].items() if st.startswith("cross-moments, ")}
        fwd = act["gflop"] - sum(mom.values())
        at = fwd / mm["bfloat16"] + sum(g / mm.get(dt, mm["float32"]) for dt, g in mom.items())
        t += at
        ratio = f"{act['seconds'] / at:.2f}" if at else "–"
        extra = (f" Activation statistics: {act['seconds']:.1f} s for {fwd:.0f} GFLOP of forward ops (both "
                 f"graphs, at the bf16 rate: the checkpoints are bf16) and {sum(mom.values()):.0f} GFLOP of "
                 f"cross-moments (each at its dtype's rate) = {at:.1f} s at the peaks: {ratio}x its count.")
    else:
        extra = ""
    return (f"Counted work at the measured peaks: {t:.1f} s of matmuls, SVDs and reads, plus "
            f"{measured:.1f} s of assignment and write as measured = {t + measured:.1f} s, against a wall "
            f"time of {r['wall_seconds']:.1f} s (the rest: analysis, gathers, casts, Python).{extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--work", default="/tmp/symgraph-scale")
    ap.add_argument("--align", default="weights", choices=("weights", "activations"))
    ap.add_argument("--sketch", type=int, default=0, help="symgraph merge --sketch K")
    ap.add_argument("--tol", type=float, default=0.0, help="symgraph merge --tol X")
    ap.add_argument("--label", default=None, help="entry name in --out (default: shape-Llayers-commit)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)
    r = run(a.shape, a.layers, a.work, a.align,
            [*(["--sketch", str(a.sketch)] if a.sketch else []), *(["--tol", str(a.tol)] if a.tol else [])])
    label = a.label or f"{a.shape}-L{a.layers}-{r['commit']}"
    write_entry(a.out, label, r, markdown)
    print(markdown({label: r}))
    return 0 if r["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

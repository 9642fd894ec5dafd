"""Cost model of out-of-core alignment: each stage of ``symgraph merge --align weights`` (or
``activations``) on :mod:`benchmarks.bench_scale`'s LLaMA-shaped bf16 pair (``--work``), run in
this process with the library's stage functions wrapped by a timing shim, its work counted:

* ``similarity``: ``alignment.weights.cross``, ``2·F·n_A·n_B·m`` FLOPs for ``[F, n, m]`` features,
  in the dtype the products run in;
* ``apply maps``: dense ``apply_along`` ``2·n·n·rest`` FLOPs; head maps block by block (``Blocks``)
  ``2·H·b²·rest``; gathers (permutations) count their bytes;
* ``procrustes``: ``torch.linalg.svd`` of ``n×n``, 22·n³ (Golub & Van Loan's R-SVD count);
* ``assignment``: ``solve.hungarian`` by how it ended, as time (counted as n³ for a reference rate);
* ``unit solve``: ``solve.nested_heads`` / ``inner_blocks`` / ``solve``, time only (inclusive);
* ``read``: checkpoint tensor reads, bytes; ``fold``; ``write``: the whole write phase;
* ``--align activations``: the statistics phase, its FLOPs the graphs' forward ops
  (``FlopCounterMode`` around each ``Stepper.run_node``) plus the cross-moments (``ActStats.add``,
  ``2·t·F_A·F_B·n_A·n_B`` in their dtype), and the graph ops run.

Achieved GFLOP/s and GB/s are set against peaks measured first in the same run (:func:`peaks`:
matmul 4096², SVD 2048², reading model A's files from the page cache). Results go to ``--out``
(JSON, one entry per ``--label``, kept across runs) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from .harness import sync as device_sync
from .provenance import best_time, cell, commit_info, matmul_gflops, table, write_entry
from .scale.checkpoints import ensure_pair, token_data, warm_cache, weight_files
from .scale.common import DEFAULT_WORK, SHAPES

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cost" / "cost.json"


def peaks(device=torch.device("cpu"), n: int = 4096, svd_n: int = 2048, files=()) -> dict:
    """Rates on ``device`` in this process (the merge's threads): matmul of ``n×n`` in float32,
    bfloat16 and float64 and SVD of ``svd_n²`` (22·n³) in float64 and float32, GFLOP/s; with
    ``files``, reading them through (from the page cache), GB/s."""
    sync = lambda: device_sync(device)  # noqa: E731
    out = {"mm_n": n, "svd_n": svd_n} | {f"mm_{k}_gflops": v for k, v in matmul_gflops(
        (torch.float32, torch.bfloat16, torch.float64), n, device, sync).items()}
    for dt in (torch.float64, torch.float32):
        s = torch.randn(svd_n, svd_n, device=device, dtype=dt)
        seconds = best_time(lambda: torch.linalg.svd(s, full_matrices=False), 1, sync)
        out[f"svd_{str(dt)[6:]}_gflops"] = 22 * svd_n ** 3 / seconds / 1e9
    if files:
        t = time.perf_counter()
        warm_cache(files)
        out["read_gbs"] = sum(os.path.getsize(f) for f in files) / (time.perf_counter() - t) / 1e9
    return out


class Counter:
    """Wraps the stage functions; ``rows`` maps stage -> [calls, seconds, flops, bytes, dtypes]."""

    def __init__(self, sync=None):
        self.rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, set()])
        self._undo = []
        self._sync = sync or (lambda: None)  # an accelerator's synchronize: each stage's own time

    def wrap(self, owner, name, stage, cost=lambda r, *a, **k: (None, 0.0, 0.0, None)):
        """``owner.name`` timed as ``stage``; ``cost(result, *args)``: ``(stage or None, flops,
        bytes, dtype)`` of a call (default: time only)."""
        f = getattr(owner, name)

        def shim(*a, **k):
            self._sync()
            t = time.perf_counter()
            r = f(*a, **k)
            self._sync()
            dt = time.perf_counter() - t
            st, flops, nbytes, dtype = cost(r, *a, **k)
            row = self.rows[f"{st or stage}, {dtype}" if dtype and flops else st or stage]
            row[:4] = row[0] + 1, row[1] + dt, row[2] + flops, row[3] + nbytes
            row[4].update([dtype] if dtype else [])
            return r
        self.replace(owner, name, shim)

    def replace(self, owner, name, new):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def undo(self):
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _cross_cost(r, xa, xb, nf, cross_fibres):
    F, Fb = math.prod(xa.shape[:nf]), math.prod(xb.shape[:nf])
    pairs = F * Fb if (nf and cross_fibres) else F
    return None, 2.0 * pairs * xa.shape[-2] * xb.shape[-2] * xa.shape[-1], 0.0, str(xa.dtype)[6:]


def _apply_cost(r, t, d, M):
    from symgraph.core.elements import Blocks, is_perm
    rest, dtype = t.numel() // t.shape[d], str(t.dtype)[6:]
    if isinstance(M, Blocks):  # per head: H·b² per column
        H, b = M.blocks.shape[:2]
        return "apply maps (blocks)", 2.0 * H * b * b * rest, 0.0, dtype
    if M.dim() == 1 or (not M.requires_grad and is_perm(M)):  # as apply_along decides
        return "apply maps (gather)", 0.0, 2.0 * t.numel() * t.element_size(), dtype
    return "apply maps (dense)", 2.0 * M.shape[0] * M.shape[1] * rest, 0.0, dtype


def instrument(sync=None) -> Counter:
    import symgraph.solve as solve_pkg
    from symgraph.alignment import weights as W
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.merging.streaming import StreamingMerge
    from symgraph.report.symmetry import SymmetryReport
    from symgraph.solve import _solvers as SV
    from symgraph.transform import folding
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
    c.wrap(folding, "fold", "fold")
    # whole unit solves as the sweep calls them (time only, inclusive of SVDs and assignments)
    c.wrap(solve_pkg, "nested_heads", "unit solve: heads (nested)")
    c.wrap(solve_pkg, "inner_blocks", "unit solve: inner blocks")
    c.wrap(solve_pkg, "solve", "unit solve", lambda r, kind, *a, **k: (f"unit solve: {kind}", 0.0, 0.0, None))
    c.wrap(StreamingMerge, "write", "write (whole phase)")
    c.wrap(SymmetryReport, "axis_map", "axis maps built")  # time only (inside similarity and write)
    _instrument_activations(c)
    return c


def _instrument_activations(c: Counter):
    """``--align activations``' statistics phase as one stage, its FLOPs the graphs' forward ops
    plus the cross-moments; and the graph ops run against one run of both graphs over every
    batch (the ops of the analysis graph × batches × 2)."""
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
    c.replace(G.Stepper, "run_node", counted_node)
    c.wrap(G.Stepper, "run_node", "graph ops run")

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
    c.replace(D, "activation_similarity", phase)
    c.wrap(D, "activation_similarity", "activation statistics (whole phase)",
           lambda r, *a, **k: (None, float(phase.flops), 0.0, None))


def stage_rows(c: Counter, pk: dict) -> dict:
    """Each counted stage: calls, seconds, GFLOP, GB, achieved rates and the fraction of the
    measured peak of its dtype (``pk``: :func:`peaks`)."""
    rows, read = {}, pk.get("read_gbs")
    for stage, (n, sec, fl, nb, dts) in c.rows.items():
        dt = ",".join(sorted(dts))
        peak = pk[f"mm_{dt}_gflops" if dt in ("bfloat16", "float64") else "mm_float32_gflops"]
        if stage.startswith("procrustes"):
            peak = pk["svd_float64_gflops"] if "float64" in dt else pk["svd_float32_gflops"]
        rate, gbs = (fl / 1e9 / sec if sec and fl else None), (nb / 1e9 / sec if sec and nb else None)
        rows[stage] = {"calls": n, "seconds": sec, "gflop": fl / 1e9, "gb": nb / 1e9, "dtype": dt, "gflops": rate,
                       "of_peak": rate / peak if rate and not stage.startswith("assignment") else None,
                       "gbs": gbs, "of_read_peak": gbs / read if gbs and read and stage.startswith("read") else None}
    return rows


def run(shape="1b", layers=2, work=DEFAULT_WORK, align="weights", extra=()) -> dict:
    from symgraph.cli.main import main as cli
    pair = ensure_pair(Path(work), shape, layers)
    a, b = pair["a"], pair["b"]
    pk = peaks(files=[str(p) for p in weight_files(a)])
    out = Path(work) / f"cost-out-{shape}-L{layers}"
    shutil.rmtree(out, ignore_errors=True)
    if align == "activations":  # bench_scale's data: DATA_ROWS random rows of DATA_TOKENS ids
        extra = [*extra, "--data", token_data(pair["dir"], SHAPES[shape]["vocab_size"])]
    with instrument() as c:
        t0 = time.perf_counter()
        rc = cli(["merge", a, b, "--out", str(out), "--align", align, *extra])
    wall = time.perf_counter() - t0
    try:  # the sweeps weight matching ran, from the merge's own record
        meta = json.loads((out / "symgraph_merge.json").read_text())
        sweeps = [x.get("seconds", {}).get("sweeps") for x in meta.get("alignments", [])]
    except (OSError, ValueError):
        sweeps = None
    shutil.rmtree(out, ignore_errors=True)
    return {"shape": shape, "layers": layers, "align": align, "options": list(extra), "rc": rc, "wall_seconds": wall,
            "sweeps": sweeps, "peaks": pk, "stages": stage_rows(c, pk), "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": (commit_info()["commit"] or "?")[:7]}


def dash(x, fmt: str = ".1f") -> str:
    """A table cell: ``format(x, fmt)``, ``–`` where ``x`` is None."""
    return cell(x, fmt, "–")


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
        lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "GB", "GB/s", "dtype"],
                       [[st, x["calls"], f"{x['seconds']:.1f}", dash(x["gflop"] or None, ".0f"),
                         dash(x["gflops"], ".0f"),
                         dash(x["of_peak"] if x["of_peak"] is not None else x.get("of_read_peak"), ".0%"),
                         dash(x["gb"] or None, ".2f"), dash(x["gbs"], ".2f"), x["dtype"]]
                        for st, x in sorted(r["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                       [None] + ["r"] * 7 + [None]) + [""]
    return "\n".join(lines)


def _at_peak(r) -> str:
    """The run's counted work at the measured peaks (matmuls at that dtype's rate, SVDs at
    theirs, reads at the page-cache rate; assignment and the write phase as measured): how long
    the same work would take at the hardware's rate, against the wall time."""
    pk, t, measured = r["peaks"], 0.0, 0.0
    mm = {"float32": pk["mm_float32_gflops"], "bfloat16": pk["mm_bfloat16_gflops"],
          "float64": pk.get("mm_float64_gflops", pk["mm_float32_gflops"] / 2)}
    for st, x in r["stages"].items():
        if st.startswith(("similarity", "apply maps (dense)", "apply maps (blocks)", "procrustes")) and x["gflop"]:
            svd = pk["svd_float64_gflops"] if "float64" in x["dtype"] else pk["svd_float32_gflops"]
            t += x["gflop"] / (svd if st.startswith("procrustes") else mm["bfloat16" if x["dtype"] == "bfloat16"
                                                                          else "float32"])
        elif st == "read" and x["gb"]:
            t += x["gb"] / pk["read_gbs"]
        elif st.startswith(("assignment", "write")):
            measured += x["seconds"]
    act, extra = r["stages"].get("activation statistics (whole phase)"), ""
    if act and act["gflop"]:
        mom = {st.split(", ")[1]: x["gflop"] for st, x in r["stages"].items() if st.startswith("cross-moments, ")}
        fwd = act["gflop"] - sum(mom.values())
        at = fwd / mm["bfloat16"] + sum(g / mm.get(dt, mm["float32"]) for dt, g in mom.items())
        t += at
        extra = (f" Activation statistics: {act['seconds']:.1f} s for {fwd:.0f} GFLOP of forward ops (both "
                 f"graphs, at the bf16 rate: the checkpoints are bf16) and {sum(mom.values()):.0f} GFLOP of "
                 f"cross-moments (each at its dtype's rate) = {at:.1f} s at the peaks: "
                 f"{dash(act['seconds'] / at if at else None, '.2f')}x its count.")
    return (f"Counted work at the measured peaks: {t:.1f} s of matmuls, SVDs and reads, plus "
            f"{measured:.1f} s of assignment and write as measured = {t + measured:.1f} s, against a wall "
            f"time of {r['wall_seconds']:.1f} s (the rest: analysis, gathers, casts, Python).{extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--work", default=DEFAULT_WORK)
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

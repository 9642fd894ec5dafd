"""Align and merge on an accelerator: a LLaMA-shaped bf16 pair built on ``--device`` (random,
seeded: ``N(0, 0.02)`` matrices and unit norm gains, :mod:`benchmarks.bench_scale`'s shapes),
merged in memory by ``symgraph.merge(..., align="weights")`` as ``symgraph merge --device``
does, against the unaligned merge (``align=None``, the linear merge) in the same run.

For each depth: the wall time of the aligned merge (analysis, alignment, combine), the unaligned
merge's, their ratio, the sweeps run and the device's peak memory. At the depths named in
``--stages`` the run is repeated with :mod:`benchmarks.bench_cost`'s stage counters, each stage
synchronised with the device before and after (so its time is its own), and the counted work
is set against the device's measured matmul and SVD rates (measured first, in this process).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import sync
from benchmarks.provenance import best_time, log, matmul_gflops, table, write_entry

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "device" / "device.json"


def peaks(device: torch.device, n: int | None = None, svd_n: int = 4096, heads: bool = True) -> dict:
    """Matmul (``n³`` products; default n = 8192 on CUDA, 4096 elsewhere) and SVD (``svd_n²``)
    rates on ``device``; ``heads``: also a 7B layer's head-pair scores."""
    n = n or (8192 if device.type == "cuda" else 4096)
    out = {"mm_n": n, "svd_n": svd_n}
    out |= {f"mm_{k}_gflops": v for k, v in matmul_gflops(
        (torch.float32, torch.bfloat16, torch.float64), n, device, lambda: sync(device)).items()}
    for dt in (torch.float64, torch.float32):
        s = torch.randn(svd_n, svd_n, device=device, dtype=dt)
        out[f"svd_{str(dt)[6:]}_gflops"] = 22 * svd_n ** 3 / best_time(
            lambda: torch.linalg.svd(s, full_matrices=False), 1, lambda: sync(device)) / 1e9
    if not heads:
        return out
    # a 7B layer's head pairs (32 x 32 of 128², float64), as solve.nested_heads scores them: on
    # the device, and as the library does (through the host: PyTorch's CUDA eigh loops over
    # matrices > 32²)
    from symgraph.solve._polar import decompose
    g = torch.randn(32, 32, 128, 128, device=device, dtype=torch.float64)
    g = g @ g.mT
    out["heads_eigvalsh_device_s"] = best_time(lambda: torch.linalg.eigvalsh(g), 1, lambda: sync(device))
    out["heads_eigvalsh_host_s"] = best_time(lambda: decompose(torch.linalg.eigvalsh, g), 1, lambda: sync(device))
    return out


def build(shape: str, layers: int, seed: int, device: torch.device):
    """A random bf16 ``LlamaForCausalLM`` of ``shape`` with ``layers`` layers on ``device``,
    initialised there (``torch.manual_seed(seed)``; the model's own init: ``N(0, 0.02)``)."""
    from transformers import LlamaForCausalLM
    from benchmarks.scale.checkpoints import llama_config
    cfg = llama_config(shape, layers)
    cfg.use_cache = False
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device if device.type in ("cpu", "cuda") else "cpu"):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return m.to(device).eval()


def _timed_merge(a, b, device, align):
    import symgraph
    sync(device)
    t = time.perf_counter()
    res = symgraph.merge([a, b], align=align)
    sync(device)
    return res, time.perf_counter() - t


def run_depth(shape: str, layers: int, device: torch.device, staged: bool, pk: dict) -> dict:
    a, b = build(shape, layers, 0, device), build(shape, layers, 1, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    res, wall = _timed_merge(a, b, device, "weights")
    al = res.alignments[1]
    out = {"layers": layers, "params": sum(p.numel() for p in a.parameters()),
           "aligned_seconds": wall, "timings": res.timings,
           "align_seconds": {k: v for k, v in al.seconds.items() if isinstance(v, (int, float))},
           "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
           "on_device": all(p.device == a.parameters().__next__().device for p in res.model.parameters())}
    del res
    _, out["unaligned_seconds"] = _timed_merge(a, b, device, None)
    out["ratio"] = out["aligned_seconds"] / out["unaligned_seconds"]
    if staged:
        from benchmarks.bench_cost import instrument, stage_rows
        c = instrument(sync=lambda: sync(device))
        t = time.perf_counter()
        try:
            _timed_merge(a, b, device, "weights")
        finally:
            c.undo()
        out["staged_seconds"] = time.perf_counter() - t
        out["stages"] = stage_rows(c, pk)
    return out


def markdown(results: dict) -> str:
    lines = ["# Align and merge on an accelerator", "",
             "Written by `python -m benchmarks.bench_device` (see its docstring): a random LLaMA-shaped "
             "bf16 pair built on the device, `symgraph.merge(..., align=\"weights\")` in memory (what "
             "`symgraph merge --device` runs) against the unaligned merge in the same run.", ""]
    for label, r in results.items():
        pk = r["peaks"]
        lines += [f"## {label}: {r['shape']} on {r['device_name']}, commit {r['commit']}, {r['when']}", "",
                  f"torch {r['torch']}; host {r['cores']} cores. Peaks on the device: matmul {pk['mm_n']}³ "
                  f"fp32 {pk['mm_float32_gflops']:.0f} GFLOP/s, bf16 {pk['mm_bfloat16_gflops']:.0f}, "
                  f"fp64 {pk['mm_float64_gflops']:.0f}; SVD 4096² fp64 {pk['svd_float64_gflops']:.0f}, "
                  f"fp32 {pk['svd_float32_gflops']:.0f} GFLOP/s."
                  + (f" A layer's head-pair scores (eigvalsh of 32 × 32 matrices of 128², fp64): "
                     f"{pk['heads_eigvalsh_device_s']:.2f} s on the device, {pk['heads_eigvalsh_host_s']:.2f} s "
                     "through the host." if "heads_eigvalsh_host_s" in pk else ""), ""]
        lines += table(["layers", "params", "align + merge", "of which analysis", "alignment", "unaligned merge",
                        "ratio", "sweeps", "peak GPU memory"],
                       [[d["layers"], f"{d['params'] / 1e9:.2f} B", f"{d['aligned_seconds']:.1f} s",
                         f"{d['timings'].get('analyze', 0):.1f} s", f"{d['timings'].get('align', 0):.1f} s",
                         f"{d['unaligned_seconds']:.1f} s", f"{d['ratio']:.1f}x", d["align_seconds"].get("sweeps", "–"),
                         "–" if d["peak_gpu_gb"] is None else f"{d['peak_gpu_gb']:.1f} GB"] for d in r["depths"]],
                       ["r"] * 9)
        f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
        for d in (d for d in r["depths"] if "stages" in d):
            lines += ["", f"Stages at {d['layers']} layers (synchronised; wall {d['staged_seconds']:.1f} s):", ""]
            lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "dtype"],
                           [[st, x["calls"], f"{x['seconds']:.2f}", f(x["gflop"] or None, ".0f"), f(x["gflops"], ".0f"),
                             f(x["of_peak"], ".1%"), x["dtype"]]
                            for st, x in sorted(d["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                           [None] + ["r"] * 5 + [None])
        lines.append("")
    return "\n".join(lines)


def header(shape: str, device: torch.device, commit: str) -> dict:
    """What a device benchmark's record starts with: the shape, the device and its name, torch,
    the host's cores, the commit and when."""
    return {"shape": shape, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or device.type,
            "torch": torch.__version__, "cores": os.cpu_count(), "commit": commit,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def device_args(prog: str, doc: str, layers: str, out: Path, layers_note: str = "",
                devices: str = "cuda or cpu") -> argparse.ArgumentParser:
    """The parser of a device benchmark with the arguments both take (``--layers`` default
    ``layers``, ``--out`` ``out``)."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{prog}", description=doc.splitlines()[0])
    ap.add_argument("--shape", default="7b", help="a bench_scale shape: tiny, 1b, 7b")
    ap.add_argument("--layers", default=layers, help="comma-separated depths, run in this order" + layers_note)
    ap.add_argument("--stages", default="2", help="depths (of --layers) also run with stage counters")
    ap.add_argument("--device", default="cuda", help=devices)
    ap.add_argument("--label", default=None)
    ap.add_argument("--commit", default=os.environ.get("SYMGRAPH_COMMIT", "?"))
    ap.add_argument("--out", default=str(out))
    return ap


def device_plan(a, prog: str):
    """``(device, depths, depths with stage counters, out)`` of :func:`device_args`' parsed ``a``
    (``out``'s directory made); None where ``--device cuda`` finds no CUDA device (said on stderr)."""
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: --device cuda but this machine has no CUDA device", file=sys.stderr)
        return None
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return device, [int(x) for x in a.layers.split(",")], {int(x) for x in a.stages.split(",") if x}, out


def main(argv=None) -> int:
    a = device_args("bench_device", __doc__, "2", DEFAULT_OUT, " (32: 218 s on an H200)").parse_args(argv)
    plan = device_plan(a, "bench_device")
    if plan is None:
        return 2
    device, depths, staged, out = plan
    label = a.label or f"{a.shape}-{device.type}-{a.commit}"
    r = {**header(a.shape, device, a.commit), "peaks": peaks(device), "depths": []}
    log(json.dumps(r["peaks"]))
    for layers in depths:  # each depth is written as soon as it is done
        r["depths"].append(run_depth(a.shape, layers, device, layers in staged, r["peaks"]))
        write_entry(out, label, r, markdown)
        log(markdown({label: r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

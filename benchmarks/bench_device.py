"""Align and merge on an accelerator: a random LLaMA-shaped bf16 pair (:mod:`benchmarks.bench_scale`'s
shapes) built on ``--device``, merged in memory by ``symgraph.merge(..., align="weights")`` (what
``symgraph merge --device`` runs) against the unaligned merge in the same run. Per depth: both
wall times (analysis, alignment, combine), their ratio, the sweeps and the device's peak memory;
at the depths of ``--stages`` the aligned merge again with :mod:`benchmarks.bench_cost`'s stage
counters (each stage synchronised with the device), its work set against the device's matmul and
SVD rates measured first.
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

from benchmarks.bench_cost import dash, instrument, stage_rows
from benchmarks.bench_cost import peaks as rates
from benchmarks.harness import sync
from benchmarks.provenance import best_time, log, table, write_entry

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "device" / "device.json"


def peaks(device: torch.device) -> dict:
    """Matmul (8192³ on CUDA, 4096³ elsewhere) and SVD (4096²) rates on ``device``
    (:func:`benchmarks.bench_cost.peaks`), and the time of a 7B layer's head-pair scores (32 × 32
    matrices of 128², float64, as ``solve.nested_heads`` scores them): on the device, and as the
    library does, through the host (PyTorch's CUDA eigh loops over matrices > 32²)."""
    from symgraph.solve._polar import decompose
    out = rates(device, 8192 if device.type == "cuda" else 4096, 4096)
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
    out = {"layers": layers, "params": sum(p.numel() for p in a.parameters()), "aligned_seconds": wall,
           "timings": res.timings,
           "align_seconds": {k: v for k, v in res.alignments[1].seconds.items() if isinstance(v, (int, float))},
           "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
           "on_device": all(p.device == next(a.parameters()).device for p in res.model.parameters())}
    del res
    _, out["unaligned_seconds"] = _timed_merge(a, b, device, None)
    out["ratio"] = out["aligned_seconds"] / out["unaligned_seconds"]
    if staged:
        with instrument(sync=lambda: sync(device)) as c:
            _, out["staged_seconds"] = _timed_merge(a, b, device, "weights")
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
                         f"{d['unaligned_seconds']:.1f} s", f"{d['ratio']:.1f}x",
                         d["align_seconds"].get("sweeps", "–"),
                         "–" if d["peak_gpu_gb"] is None else f"{d['peak_gpu_gb']:.1f} GB"] for d in r["depths"]],
                       ["r"] * 9)
        for d in (d for d in r["depths"] if "stages" in d):
            lines += ["", f"Stages at {d['layers']} layers (synchronised; wall {d['staged_seconds']:.1f} s):", ""]
            lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "dtype"],
                           [[st, x["calls"], f"{x['seconds']:.2f}", dash(x["gflop"] or None, ".0f"),
                             dash(x["gflops"], ".0f"), dash(x["of_peak"], ".1%"), x["dtype"]]
                            for st, x in sorted(d["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                           [None] + ["r"] * 5 + [None])
        lines.append("")
    return "\n".join(lines)


def header(shape: str, device: torch.device, commit: str) -> dict:
    """What a device benchmark's record starts with: the shape, the device and its name, torch,
    the host's cores, the commit and when."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or device.type
    return {"shape": shape, "device": str(device), "device_name": name, "torch": torch.__version__,
            "cores": os.cpu_count(), "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def device_args(prog: str, doc: str, layers: str, out: Path, devices: str = "cuda or cpu") -> argparse.ArgumentParser:
    """The parser of a device benchmark with the arguments both take (``--layers`` default
    ``layers``, ``--out`` ``out``)."""
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{prog}", description=doc.splitlines()[0])
    ap.add_argument("--shape", default="7b", help="a bench_scale shape: tiny, 1b, 7b")
    ap.add_argument("--layers", default=layers, type=ints, help="comma-separated depths, run in this order")
    ap.add_argument("--stages", default="2", type=ints, help="depths (of --layers) also run with stage counters")
    ap.add_argument("--device", default="cuda", help=devices)
    ap.add_argument("--label", default=None)
    ap.add_argument("--commit", default=os.environ.get("SYMGRAPH_COMMIT", "?"))
    ap.add_argument("--out", default=str(out), type=Path)
    return ap


def device_of(a, prog: str) -> torch.device | None:
    """``--device`` of :func:`device_args`' parsed ``a`` (``--out``'s directory made); None where
    ``--device cuda`` finds no CUDA device (said on stderr)."""
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: --device cuda but this machine has no CUDA device", file=sys.stderr)
        return None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    return device


def main(argv=None) -> int:
    a = device_args("bench_device", __doc__, "2", DEFAULT_OUT).parse_args(argv)
    device = device_of(a, "bench_device")
    if device is None:
        return 2
    label = a.label or f"{a.shape}-{device.type}-{a.commit}"
    r = {**header(a.shape, device, a.commit), "peaks": peaks(device), "depths": []}
    log(json.dumps(r["peaks"]))
    for layers in a.layers:  # each depth is written as soon as it is done
        r["depths"].append(run_depth(a.shape, layers, device, layers in a.stages, r["peaks"]))
        write_entry(a.out, label, r, markdown)
        log(markdown({label: r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

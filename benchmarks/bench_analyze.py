"""Cost of ``symgraph.analyze`` on a Llama-3-8B-shaped model, relative to ``torch.export``.

The model is built on the ``meta`` device (no weights), exported with the same inputs
(``input_ids`` of shape ``[1, 8]``, ``use_cache=False``) once on its own and once inside
``symgraph.analyze``; the ratio of the two wall times is what the analysis adds on top of the
trace it cannot avoid. Targets: ratio <= 1.3 and peak memory < 2 GB.

    python -m benchmarks.bench_analyze [--layers 32] [--repeats 3] [--out PATH]

Timings are the median of ``--repeats`` interleaved runs after one warm-up export (the first
export in a process pays for imports and dispatcher caches). Memory is measured in a separate
run under ``tracemalloc`` (Python allocations during one ``analyze``), and the process's peak
resident set (``ru_maxrss``) is reported too.
"""
from __future__ import annotations

import argparse
import collections
import gc
import platform
import statistics
import time
import tracemalloc
import warnings

import torch

from .harness import peak_rss_mb
from .provenance import write_beside

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TARGET_RATIO = 1.3
TARGET_PEAK_MB = 2048.0


def _export(model, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model, (), dict(kwargs), strict=False)


def _analyze(model, kwargs):
    import symgraph
    return symgraph.analyze(model, {"input_ids": kwargs["input_ids"]})


def _timed(fn, *a):
    gc.collect()
    t = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t, out


def run(layers: int | None = None, repeats: int = 3) -> dict:
    import transformers

    import symgraph
    from symgraph.passes import analyze_graph
    from symgraph.passes.trace import trace
    transformers.logging.set_verbosity_error()
    config = {**LLAMA3_8B, **({"num_hidden_layers": layers} if layers else {})}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    kwargs = {"input_ids": torch.zeros(1, 8, dtype=torch.long, device="meta"), "use_cache": False}
    _export(model, kwargs)  # warm-up: imports, dispatcher and fake-tensor caches
    export_s, analyze_s = [], []
    for _ in range(repeats):
        export_s.append(_timed(_export, model, kwargs)[0])
        t, report = _timed(_analyze, model, kwargs)
        analyze_s.append(t)
    # where the time goes inside analyze: trace (export + any decompositions) vs the passes
    t_trace, (ep, _args, _kw) = _timed(trace, model, {"input_ids": kwargs["input_ids"]})
    t_passes, an = _timed(analyze_graph, ep, False, symgraph.tied_parameters(model))
    t_report, _ = _timed(symgraph.SymmetryReport, an, type(model).__name__, ((), {}))
    n_nodes = sum(1 for n in ep.graph.nodes if n.op == "call_function")
    del ep, an
    gc.collect()
    tracemalloc.start()
    _analyze(model, kwargs)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    exp_med, ana_med = statistics.median(export_s), statistics.median(analyze_s)
    res = {
        "model": "LlamaForCausalLM (Llama-3-8B shapes, meta device)", "config": config,
        "parameters": sum(p.numel() for p in model.parameters()), "graph_nodes": n_nodes,
        "inputs": {"input_ids": [1, 8], "use_cache": False}, "repeats": repeats,
        "export_s": export_s, "analyze_s": analyze_s, "export_median_s": exp_med, "analyze_median_s": ana_med,
        "ratio": ana_med / exp_med,
        "ratio_min": min(analyze_s) / min(export_s),  # less sensitive to other load: best of each
        "passes_fraction": (t_passes + t_report) / exp_med,  # the passes on top of the trace, ÷ export
        "breakdown_s": {"trace": t_trace, "passes": t_passes, "report": t_report},
        "tracemalloc_peak_mb": peak / 2 ** 20, "max_rss_mb": peak_rss_mb(), "groups": len(report.groups),
        "group_kinds": dict(sorted(collections.Counter(g.kind for g in report.groups).items())),
        "frozen_ops": len(report.frozen), "degrees_of_freedom": report.degrees_of_freedom,
        "targets": {"ratio": TARGET_RATIO, "peak_mb": TARGET_PEAK_MB},
        "torch": torch.__version__, "python": platform.python_version(), "transformers": transformers.__version__,
    }
    res["meets_targets"] = bool(res["ratio"] <= TARGET_RATIO
                                and max(res["tracemalloc_peak_mb"], res["max_rss_mb"]) < TARGET_PEAK_MB)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/analyze_8b.json", help="JSON output path")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (32)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    res = run(layers=args.layers, repeats=args.repeats)
    if args.out:
        write_beside(args.out, res)
    for k, v in res.items():
        print(f"{k:>22}: {v:.4g}" if isinstance(v, float) else f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

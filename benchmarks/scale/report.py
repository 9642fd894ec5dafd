"""The Markdown table of a scale result."""
from __future__ import annotations

from ..provenance import table
from .common import GB, STAGES


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _writer_note(pair: dict) -> str:
    w = pair.get("write") or {}
    if not w or any("peak_rss_gb" not in v for v in w.values()):
        return ""
    return (f" Pair {'written now' if pair.get('written') else 'reused'}: "
            f"{max(v['seconds'] for v in w.values()):.1f} s per model, "
            f"writer peak RSS {max(v['peak_rss_gb'] for v in w.values()):.2f} GB.")


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Scale benchmark: `symgraph merge` vs mergekit (linear, bf16)", "",
             f"Machine: {m['cores']} cores ({m.get('cpu')}), {_f(m['ram_gb'], '{:.1f}')} GB RAM, "
             f"device {m['device']}, torch {m['torch']}, transformers {m['transformers']}, "
             f"Python {m['python']}.", "",
             "Each stage is a separate process; peak RSS is the child's `ru_maxrss` (file-backed "
             "mmap pages included), GB = 10^9 bytes. Ratios are against `mergekit_linear` of the "
             "same run. Written by `python -m benchmarks.bench_scale` (see its docstring).", ""]
    for rec in result["shapes"]:
        s = rec["stages"]
        mk = rec.get("mergekit", {}).get("versions")
        lines += [f"## {rec['shape']}: {rec['layers']} of {rec['full_layers']} layers, "
                  f"{rec['parameters'] / 1e9:.3f} B parameters, {rec['bytes_on_disk_per_model'] / GB:.2f} GB "
                  f"per model on disk", "",
                  f"hidden {rec['config']['hidden_size']}, MLP {rec['config']['intermediate_size']}, "
                  f"{rec['config']['num_attention_heads']} heads / "
                  f"{rec['config']['num_key_value_heads']} KV, "
                  f"vocab {rec['config']['vocab_size']}; one layer {rec['layer_bytes'] / GB:.3f} GB, "
                  f"embeddings + head + norm {rec['nonlayer_bytes'] / GB:.3f} GB; full depth "
                  f"{rec['full_model_bytes'] / GB:.2f} GB per model. "
                  f"Page cache before merges: {rec['cache']}, earlier outputs written back (os.sync)."
                  + (f" symgraph's --memory-budget: {rec['run']['memory_budget']}."
                     if rec["run"].get("memory_budget") else "")
                  + _writer_note(rec["pair"]) +
                  f" Run {rec['run']['time']}, symgraph {rec['run']['symgraph_commit']}"
                  + (f", mergekit/torch/transformers {mk}" if mk else "") + "." + _rates_note(rec), ""]
        rows = []
        for name in STAGES:
            r = s.get(name)
            if r is None:
                continue
            if "skipped" in r:
                rows.append(f"| {name} | | | | | | | | | skipped: {r['skipped']} |")
                continue
            status = "ok" if r["ok"] else f"**failed** rc {r['rc']}: {r.get('error') or ''}".replace("|", "/")
            if name.startswith("read") and r.get("read"):
                rd = r["read"]
                status += (f": {rd['bytes'] / GB:.3g} GB in {rd['seconds']:.3g} s = "
                           f"{rd['gb_per_s']:.2f} GB/s (read loop only)")
            rows.append([name, f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['peak_rss_gb']:.2f}",
                         f"{r['bytes_in'] / GB:.3g}", _f(r.get("bytes_out") and r["bytes_out"] / GB, "{:.3g}"),
                         f"{r['seconds_per_layer']:.2f}", _f(r.get("time_ratio_vs_mergekit")),
                         _f(r.get("rss_ratio_vs_mergekit")), status])
        lines += table(["stage", "wall s", "CPU s", "peak RSS GB", "in GB", "out GB", "s / layer", "time × mergekit",
                        "RSS × mergekit", "status"], rows, [None] + ["r"] * 8 + [None])
        c = rec.get("checks", {})
        checks = [f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in c.items()
                  if isinstance(v, dict) and "ok" in v]
        checks = [f"input {m_} {'ok' if v['ok'] else 'FAILED'}"
                  for m_, v in c.get("inputs", {}).items()] + checks
        if s.get("symgraph_weights", {}).get("time_ratio_vs_baseline"):
            lines += ["", f"symgraph_weights against the same command at the baseline commit "
                      f"`{rec['run']['baseline_commit']}` (symgraph_weights_baseline, this run): "
                      f"{s['symgraph_weights']['time_ratio_vs_baseline']:.3f}× its time."]
        sweeps = [f"{n_} {', '.join(map(str, r_['sweeps']))}" for n_, r_ in rec["stages"].items() if r_.get("sweeps")]
        if sweeps:
            lines += ["", "Sweeps of weight matching (from each output's `symgraph_merge.json`): " + "; ".join(sweeps) + "."]
        lines += ["", "Checks (" + ("`from_pretrained` + " if c.get("from_pretrained") else "")
                  + "names/shapes/bf16 from headers): " + (", ".join(checks) or "none") + "."]
        cmp_ = c.get("none_vs_mergekit")
        if cmp_ and "symgraph_vs_mergekit" in cmp_:
            sm, se, me = (cmp_[k] for k in ("symgraph_vs_mergekit", "symgraph_vs_exact", "mergekit_vs_exact"))
            lines.append(f"`--align none` vs mergekit over {cmp_['elements'] / 1e6:.1f} M elements: "
                         f"max |diff| {sm['max_abs_diff']:.3g}, {sm['elements_differ']} elements differ, "
                         f"within 1 bf16 ulp: {sm['within_1ulp']}; against exact bf16(0.5A+0.5B): "
                         f"symgraph max |diff| {se['max_abs_diff']:.3g} ({se['elements_differ']} differ), "
                         f"mergekit {me['max_abs_diff']:.3g} ({me['elements_differ']} differ).")
        elif cmp_:
            lines.append(f"`--align none` vs mergekit: FAILED ({cmp_.get('error')}).")
        lines.append("")
    return "\n".join(lines)


def _rates_note(rec) -> str:
    """The machine's matmul rates before and after the stages (:func:`.measure.matmul_rates`)."""
    r = rec.get("matmul_gflops") or {}
    b, a = r.get("before"), r.get("after")
    if not b or not a:
        return ""
    return (f" The machine's matmul rates (4096², best of 3, a fresh process) before / after the stages: "
            f"float32 {b['float32']:.0f} / {a['float32']:.0f} GFLOP/s, bfloat16 {b['bfloat16']:.0f} / "
            f"{a['bfloat16']:.0f} GFLOP/s.")

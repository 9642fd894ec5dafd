"""Figures and ``report.md`` of the benchmark suite (from the records of ``results.json``)."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import torch

from . import targets
from .barrier_plot import barrier_plot
from .methods import DEVIATIONS, METHODS, SEED_METHODS, SYMGRAPH_METHODS, roles
from .provenance import markdown_table, mean_sd, mean_sd_cell, pyplot, save_figure
from .records import FORMER_NAMES, RENAME_NOTE, renamed

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEATMAP_ARCHS = ("gpt2", "bert", "vit", "llama")
GRAPH_ARCHS = ("llama", "gpt2", "bert", "vit")


# --- figures ---------------------------------------------------------------------------------


def plots(out: Path, records, keep, archs) -> list[str]:
    """Write every figure into ``out``; returns their file names."""
    records, names = renamed(records), []
    for arch in archs:
        names.append(barrier_plot(out / f"barrier_{arch}.png", records, arch))
    arch = next((a for a in HEATMAP_ARCHS if a in keep and keep[a]), None)
    if arch is not None:
        names.append(correlation_heatmap(out / "attention_correlation.png", arch, keep[arch]))
    arch = next((a for a in GRAPH_ARCHS if a in keep and keep[a]), None)
    if arch is not None:
        path = out / f"class_graph_{arch}.png"
        keep[arch]["pair"].report_a.save_graph(str(path))
        names.append(path.name)
    return names


def _output_projection(report):
    """(module name, head dim) of the first layer's attention output projection, by structure."""
    r = roles(report)
    vo = min(r.vo_inner)
    g = report.groups[vo]
    name = next(n for n, _ in g.params if n in r.out_params)
    return name.rsplit(".", 1)[0], g.dim


def _capture(model, module_name, arch, batches):
    from . import evaluate
    feats = []
    mod = model.get_submodule(module_name)
    h = mod.register_forward_pre_hook(lambda m, args: feats.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for b in batches:
                evaluate.model_logits(model, arch, b)
    finally:
        h.remove()
    return torch.cat(feats).double()


def _corr(x, y):
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-12)
    y = (y - y.mean(0)) / y.std(0).clamp_min(1e-12)
    return (x.T @ y / x.shape[0]).numpy()


def correlation_heatmap(path: Path, arch, keep) -> str:
    """Cross-correlation of A's and B's attention outputs (input of the first layer's output
    projection), before and after alignment (symgraph, activations); head boundaries drawn."""
    from . import evaluate
    plt = pyplot()
    p = keep["pair"]
    module, dh = _output_projection(p.report_a)
    batches = evaluate.eval_batches(arch, "eval", 2)
    xa = _capture(p.a, module, arch, batches)
    before = _corr(xa, _capture(p.b, module, arch, batches))
    after = _corr(xa, _capture(keep["b_aligned"], module, arch, batches))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), constrained_layout=True)
    for ax, c, title in ((axes[0], before, "before alignment"), (axes[1], after, "after (symgraph, activations)")):
        im = ax.imshow(c, cmap="RdBu_r", vmin=-1, vmax=1)
        for k in range(dh, c.shape[0], dh):
            ax.axhline(k - 0.5, color="k", lw=0.4)
            ax.axvline(k - 0.5, color="k", lw=0.4)
        ax.set_title(f"{title}\nmean diagonal {np.mean(np.diag(c)):.2f}", fontsize=10)
        ax.set_xlabel("B feature")
        ax.set_ylabel("A feature")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(f"{arch}: corr(A, B) of the attention output (input of {module}), {dh}-dim heads")
    save_figure(fig, path, bbox_inches="tight")
    keep["heatmap"] = {"module": module, "head_dim": dh, "diag_before": float(np.mean(np.diag(before))),
                       "diag_after": float(np.mean(np.diag(after)))}
    return path.name


# --- report.md -------------------------------------------------------------------------------


def _by(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


def _stat(records, arch, method, key):
    return mean_sd([r[key] for r in _by(records, arch=arch, method=method)])


def markdown(records, summary, figures) -> str:
    """``report.md`` from the suite's records (former seed-method names read as the current ones)."""
    records = renamed(records)
    archs = summary["archs"]
    methods = [m for m in (FORMER_NAMES.get(m, m) for m in summary["methods"]) if any(_by(records, method=m))]
    st = summary["settings"]
    n_pairs = {a: len({tuple(r["pair"]) for r in _by(records, arch=a, method=methods[0])}) for a in archs}
    L = ["# symgraph benchmark suite", ""]
    L.append(f"Protocol **{summary['protocol']}**, model size **{st['size']}**, seeds {st['seeds']}, "
             f"pairs per architecture {n_pairs}, {summary['threads']} torch thread(s), torch "
             f"{summary['torch']}, Python {summary['python']}, symgraph at `{summary.get('symgraph_commit')}`. Wall time {summary['wall_seconds']:.0f} s "
             f"(training / loading {summary['train_seconds']:.0f} s). Curves: 21-point λ grid on "
             f"{st['curve_batches'] or 'all'} held-out batches; λ=0.5 metric on "
             f"{st['metric_batches'] or 'all'} held-out batches; activation statistics from "
             f"{st['align_batches']} training batches.")
    L.append("")
    L.append("Regenerate: `python -m benchmarks" + (" --quick" if summary["protocol"] == "quick" else "")
             + (f" --size {st['size']}" if st["size"] != summary["protocol"] else "")
             + (" --seeds " + " ".join(map(str, st["seeds"])) if list(st["seeds"]) != [0, 1, 2] else "")
             + "".join(f" --no-{k}" for k in summary.get("skipped", ()))
             + "`.")
    L += ["", "## Models", ""]
    rows = []
    from . import evaluate
    for a in archs:
        rs = _by(records, arch=a, method=methods[0])
        losses = {s: l for r in rs for s, l in zip(r["pair"], (r["loss_a"], r["loss_b"]))}
        mets = {s: m for r in rs for s, m in zip(r["pair"], (r["metric_a"], r["metric_b"]))}
        rows.append([a, rs[0]["metric_name"], mean_sd_cell(mean_sd(list(losses.values()))),
                     mean_sd_cell(mean_sd(list(mets.values()))), f"{evaluate.baseline_loss(a):.3f}"])
    L.append(markdown_table(["arch", "metric", "held-out loss (seeds)", "metric (seeds)", "unigram/prior loss"],
                            rows))
    L += ["", "## Loss barrier (mean ± std over pairs; lower is better)", "",
          "Interpolation methods: `max_λ L(λθ_A + (1−λ)θ_B′) − ½(L_A + L_B)` on the 21-point grid, "
          "with the original B's loss. Fisher / RegMean produce one merged model: their entry is the "
          "midpoint gap `L(merged) − ½(L_A + L_B)`. Best per column in bold.", "", RENAME_NOTE, ""]
    L.append(_metric_table(records, archs, methods, "barrier", best=min))
    L += targets.section(records, archs)
    L += ["", "## Held-out loss of the merged model (λ = 0.5)", ""]
    L.append(_metric_table(records, archs, methods, "loss_mid", best=min))
    L += ["", "## Task metric of the merged model (λ = 0.5)", "",
          "Perplexity for the language models (lower is better), accuracy for the ViT (higher is better).", ""]
    L.append(_metric_table(records, archs, methods, "metric_mid", best=None))
    L += ["", "## Method time (seconds; alignment + merge, no evaluation)", ""]
    L.append(_metric_table(records, archs, methods, "seconds", best=None, digits=2))
    soft = [r for r in records if r["method"] == "imfeld2024" and r["kind"] == "interpolation"]
    if soft:
        L += ["", "Soft transport maps (imfeld2024) change B's function: L(B′) − L(B) = "
              + ", ".join(f"{a}: {mean_sd_cell(mean_sd([r['loss_b_aligned'] - r['loss_b'] for r in soft if r['arch'] == a]))}"
                          for a in archs) + " nats; the barrier measured against B′'s own endpoint "
              "(`barrier_curve`) is " + ", ".join(
                  f"{a}: {mean_sd_cell(mean_sd([r['barrier_curve'] for r in soft if r['arch'] == a]))}" for a in archs) + "."]
    L += _hetero_section(records)
    L += _speed_section(records, archs)
    L += ["", "## Figures", ""]
    for f in figures:
        L.append(f"- `{f}`" + (f"  \n  ![{f}]({f})" if f.endswith(".png") else ""))
    L += ["", "## Methods and deviations from the seeds", "", RENAME_NOTE, ""]
    for m in methods:
        L.append(f"- **{m}** — {METHODS[m][1]}." + (f" *Deviation:* {DEVIATIONS[m]}" if m in DEVIATIONS else ""))
    L += ["", "Full descriptions: the docstrings of `benchmarks/methods.py`.", ""]
    L += ["## Findings", ""] + findings(records, archs, methods, summary)
    return "\n".join(L) + "\n"


def _metric_table(records, archs, methods, key, best=min, digits=3):
    rows = []
    stats = {(m, a): _stat(records, a, m, key) for m in methods for a in archs}
    bests = {}
    if best is not None:
        for a in archs:
            vals = [stats[(m, a)][0] for m in methods if stats[(m, a)][0] is not None]
            bests[a] = best(vals) if vals else None
    for m in methods:
        row = [m]
        for a in archs:
            s = mean_sd_cell(stats[(m, a)], digits)
            row.append(f"**{s}**" if best is not None and stats[(m, a)][0] == bests[a] else s)
        rows.append(row)
    return markdown_table(["method"] + list(archs), rows)


def _hetero_section(records):
    hs = [r for r in records if r["kind"] == "hetero"]
    if not hs:
        return []
    L = ["", "## Heterogeneous fusion: `gpt2_wide` (2× MLP) into `gpt2`", "",
         "B (wide) is aligned into A's (narrow) basis and widths (transport maps for the MLP class), "
         "then averaged at λ = 0.5. \"vs narrow alone\" = L(narrow) − L(merged): positive means the "
         "fused model beats the narrow model trained alone.", ""]
    rows = []
    for m in dict.fromkeys(r["method"] for r in hs):
        rs = [r for r in hs if r["method"] == m]
        ms = lambda k: mean_sd_cell(mean_sd([r[k] for r in rs]))  # noqa: E731
        rows.append([m, len(rs), ms("loss_a"), ms("loss_b"), ms("loss_b_aligned"), ms("loss_mid"),
                     ms("gain_vs_narrow"), ms("metric_a"), ms("metric_mid")])
    L.append(markdown_table(["method", "pairs", "L(narrow)", "L(wide)", "L(wide→narrow width)", "L(merged)",
                             "vs narrow alone", "ppl(narrow)", "ppl(merged)"], rows))
    return L


def _speed_section(records, archs):
    sp = [r for r in records if r["kind"] == "speed"]
    L = ["", "## Speed and memory", ""]
    if sp:
        L.append("Each architecture measured in a fresh process (two trained models of this run): "
                 "peak resident set during the step (sampled every ms) above the resident set after "
                 "loading both models; analyze columns cover both models, the time column one.")
        L.append("")
        rows = []
        for a in archs:
            d = {r["method"]: r for r in sp if r["arch"] == a}
            if not d:
                continue
            det = d["analyze"]["detail"]
            rows.append([a, f"{det['parameters']:,}", det["groups"], f"{d['analyze']['seconds']:.2f}",
                         f"{d['align_weights']['seconds']:.2f}", f"{d['align_activations']['seconds']:.2f}",
                         f"{d['analyze']['peak_rss_mb']:.0f}", f"{d['align_weights']['peak_rss_mb']:.0f}",
                         f"{d['align_activations']['peak_rss_mb']:.0f}"])
        L.append(markdown_table(["arch", "params", "groups", "analyze s (one model)", "align s (weights)",
                                 "align s (activations)", "peak MB analyze (both)", "peak MB align(w)",
                                 "peak MB align(act)"], rows))
    for path in sorted(glob.glob(str(RESULTS_DIR / "align_bert_base*.json"))):
        # records written before the seed methods were named after their papers say seed003
        d = {k.replace("seed003", "zhang2025"): v for k, v in json.loads(Path(path).read_text()).items()}
        L += ["", f"**BERT-base-shaped align** (`benchmarks/results/{os.path.basename(path)}`): {d.get('config')}; "
              f"align {d['align_seconds']:.1f} s (solver share {d['align_solver_share']:.0%}, {d.get('sweeps')} sweeps) "
              f"vs a plain Zhang et al. 2024 matching {d['zhang2025_seconds']:.1f} s (ratio {d['ratio_align_over_zhang2025']:.2f}×); "
              f"peak RSS {d['peak_rss_mb']:.0f} MB = {d['peak_over_weights']:.1f}× the two models' weights; "
              f"exact-recovery error {d['recovery_max_rel_error']:.1e}."]
    p8 = RESULTS_DIR / "analyze_8b.json"
    if p8.exists():
        d = json.loads(p8.read_text())
        L += ["", f"**8B-shaped analyze** (`benchmarks/results/analyze_8b.json`): {d['model']}, "
              f"{d['parameters']:,} parameters, {d['graph_nodes']} graph nodes: analyze "
              f"{d['analyze_median_s']:.1f} s vs torch.export {d['export_median_s']:.1f} s "
              f"(ratio {d['ratio']:.2f}×), passes {d['passes_fraction']:.1%} of it; "
              f"{d['groups']} groups {d['group_kinds']}; tracemalloc peak {d['tracemalloc_peak_mb']:.0f} MB, "
              f"max RSS {d['max_rss_mb']:.0f} MB; {d['frozen_ops']} frozen ops."]
    return L


def findings(records, archs, methods, summary) -> list[str]:
    """Plain statements computed from the numbers (regenerated with the report)."""
    F = []
    mean = lambda a, m, k="barrier": _stat(records, a, m, k)[0]  # noqa: E731
    beats = []
    for a in archs:
        v = mean(a, "vanilla")
        sym = {m: mean(a, m) for m in SYMGRAPH_METHODS if m in methods}
        sym = {m: x for m, x in sym.items() if x is not None}
        if v is None or not sym:
            continue
        bm = min(sym, key=sym.get)
        ok = sym[bm] < v
        beats.append(ok)
        per_pair = _per_pair_wins(records, a, bm)
        F.append(f"- **{a}**: vanilla barrier {v:.3f}; best symgraph method `{bm}` {sym[bm]:.3f} "
                 f"({'lower' if ok else 'NOT lower'} than vanilla by {v - sym[bm]:+.3f}; lower on "
                 f"{per_pair[0]}/{per_pair[1]} pairs).")
        seeds = {m: mean(a, m) for m in methods if m in SEED_METHODS and mean(a, m) is not None}
        better = {m: x for m, x in seeds.items() if x < sym[bm]}
        if better:
            F.append("  - A seed method beats symgraph's best here: " + ", ".join(
                f"`{m}` {x:.3f}" for m, x in sorted(better.items(), key=lambda t: t[1])) + ".")
        for sm, sx in sorted(sym.items()):
            worse = {m: x for m, x in seeds.items() if x < sx and m not in better}
            if sm != bm and worse:
                F.append(f"  - Seed methods with a lower barrier than `{sm}` ({sx:.3f}): " + ", ".join(
                    f"`{m}` {x:.3f}" for m, x in sorted(worse.items(), key=lambda t: t[1])) + ".")
        allm = {m: mean(a, m) for m in methods if mean(a, m) is not None}
        top = min(allm, key=allm.get)
        if top not in sym:
            F.append(f"  - Lowest barrier overall: `{top}` {allm[top]:.3f}"
                     + (" (a single merged model: midpoint gap, not an interpolation barrier)."
                        if top.startswith(("fisher", "regmean")) else "."))
    if beats:
        F.insert(0, f"- Some symgraph method has a lower mean barrier than vanilla averaging on "
                    f"{sum(beats)}/{len(beats)} architectures.")
    from . import evaluate
    for a in archs:
        hib = evaluate.higher_is_better(a)
        vals = {m: _stat(records, a, m, "metric_mid")[0] for m in methods}
        vals = {m: x for m, x in vals.items() if x is not None}
        if not vals:
            continue
        top = (max if hib else min)(vals, key=vals.get)
        name = evaluate.metric_name(a)
        syms = {m: vals[m] for m in SYMGRAPH_METHODS if m in vals}
        line = (f"- Merged-model {name} on {a} (λ = 0.5): best `{top}` {vals[top]:.3f}, vanilla "
                f"{vals.get('vanilla', float('nan')):.3f}")
        if syms:
            bs = (max if hib else min)(syms, key=syms.get)
            line += f", best symgraph `{bs}` {syms[bs]:.3f}"
        if top in SEED_METHODS:
            line += " — a seed method has the best merged model here"
        F.append(line + ".")
    s3, s3r = [], []
    for a in archs:
        x, v, y = mean(a, "zhang2025"), mean(a, "vanilla"), mean(a, "zhang2025_rescale")
        sym = min((mean(a, m) for m in SYMGRAPH_METHODS if mean(a, m) is not None), default=None)
        if x is not None and v is not None and sym is not None:
            s3.append((a, v - x, v - sym))
        if x is not None and y is not None:
            sc = [abs(s - 1) for r in _by(records, arch=a, method="zhang2025_rescale")
                  for ss in (r.get("extra") or {}).get("scales", {}).values() for s in ss]
            s3r.append(f"{a} {x - y:+.4f} (mean |a−1| = {np.mean(sc) if sc else float('nan'):.3f})")
    if s3:
        F.append("- `zhang2025` (MLP + per-head rotations from weights; no residual-stream or head "
                 "permutation) lowers the mean barrier relative to vanilla by " + ", ".join(
                     f"{a} {d:+.3f}" for a, d, _ in s3) + " nats, against " + ", ".join(
                     f"{a} {d:+.3f}" for a, _, d in s3) + " for symgraph's best.")
        if all(d < 0.5 * ds for _, d, ds in s3 if ds > 0):
            F.append("  Between models trained from different initialisations the residual bases differ; "
                     "matching MLP units and per-head rotations in unaligned residual coordinates recovers "
                     "less than half of what aligning the residual stream and head order does. `zhang2025` "
                     "targets models fine-tuned from one checkpoint, whose residual basis is shared.")
    if s3r:
        F.append("- `zhang2025`'s scalar rescaling (`zhang2025_rescale`) changes the mean barrier by " + ", ".join(s3r) + " nats.")
    for base in ("fisher", "regmean"):
        parts = []
        for a in archs:
            x, y = mean(a, base), mean(a, base + "_aligned")
            if x is not None and y is not None:
                parts.append(f"{a} {x:.3f} → {y:.3f}")
        hurt = [a for a in archs if mean(a, base) is not None and mean(a, base + "_aligned") is not None
                and mean(a, base + "_aligned") > mean(a, base)]
        if parts:
            F.append(f"- {base.capitalize()} midpoint gap without → with symgraph alignment: " + "; ".join(parts) + "."
                     + (f" Alignment makes it worse on {', '.join(hurt)}." if hurt else ""))
    soft = [r for r in records if r["method"] == "imfeld2024" and r["kind"] == "interpolation"]
    if soft:
        parts = []
        for a in archs:
            mid, sym = mean(a, "imfeld2024", "loss_mid"), mean(a, "symgraph_activations", "loss_mid")
            bar = mean(a, "imfeld2024")
            if mid is not None and sym is not None:
                parts.append(f"{a} L(0.5) {mid:.3f} vs symgraph_activations {sym:.3f} (barrier {bar:.3f})")
        rise = mean_sd([r["loss_b_aligned"] - r["loss_b"] for r in soft])[0]
        F.append(f"- `imfeld2024`'s soft maps are not symmetries: B′ is a different function (L(B′) − L(B) = "
                 f"{rise:+.3f} nats on average), so its barrier against the original endpoints includes "
                 "that loss; midpoints: " + "; ".join(parts) + ".")
    hs = [r for r in records if r["kind"] == "hetero"]
    if hs:
        parts = []
        for m in dict.fromkeys(r["method"] for r in hs):
            g = mean_sd([r["gain_vs_narrow"] for r in hs if r["method"] == m])[0]
            parts.append(f"`{m}` {'beats' if g > 0 else 'does not beat'} the narrow model alone ({g:+.3f} nats)")
        F.append("- Heterogeneous fusion (wide → narrow, then average): " + "; ".join(parts) + ".")
    hm = summary.get("heatmap")
    if hm:
        F.append(f"- Attention-output correlation at `{hm['module']}`: mean diagonal {hm['diag_before']:.2f} "
                 f"before alignment, {hm['diag_after']:.2f} after (symgraph, activations).")
    return F


def _per_pair_wins(records, arch, method):
    van = {tuple(r["pair"]): r["barrier"] for r in _by(records, arch=arch, method="vanilla")}
    got = {tuple(r["pair"]): r["barrier"] for r in _by(records, arch=arch, method=method)}
    return sum(got[p] < van[p] for p in got if p in van), len(got)

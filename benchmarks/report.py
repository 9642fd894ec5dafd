"""Figures and ``report.md`` of the benchmark suite, from its records (``results.json``); records
under the seed methods' former names read as the current ones (:mod:`benchmarks.records`)."""
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


def plots(out: Path, records, keep, archs) -> list[str]:
    """Every figure written into ``out``; their file names."""
    records = renamed(records)
    names = [barrier_plot(out / f"barrier_{arch}.png", records, arch) for arch in archs]
    arch = next((a for a in HEATMAP_ARCHS if keep.get(a)), None)
    if arch is not None:
        names.append(correlation_heatmap(out / "attention_correlation.png", arch, keep[arch]))
    arch = next((a for a in GRAPH_ARCHS if keep.get(a)), None)
    if arch is not None:
        path = out / f"class_graph_{arch}.png"
        keep[arch]["pair"].report_a.save_graph(str(path))
        names.append(path.name)
    return names


def _output_projection(report):
    """(module name, head dim) of the first layer's attention output projection, by structure."""
    r = roles(report)
    g = report.groups[min(r.vo_inner)]
    name = next(n for n, _ in g.params if n in r.out_params)
    return name.rsplit(".", 1)[0], g.dim


def _capture(model, module_name, arch, batches):
    """The inputs of ``module_name`` over ``batches``, one row per token (float64)."""
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


def _by(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


def _stat(records, arch, method, key):
    return mean_sd([r[key] for r in _by(records, arch=arch, method=method)])


def markdown(records, summary, figures) -> str:
    """``report.md`` from the suite's records."""
    records = renamed(records)
    archs, st = summary["archs"], summary["settings"]
    methods = [m for m in (FORMER_NAMES.get(m, m) for m in summary["methods"]) if any(_by(records, method=m))]
    n_pairs = {a: len({tuple(r["pair"]) for r in _by(records, arch=a, method=methods[0])}) for a in archs}
    L = ["# symgraph benchmark suite", "",
         f"Protocol **{summary['protocol']}**, model size **{st['size']}**, seeds {st['seeds']}, "
         f"pairs per architecture {n_pairs}, {summary['threads']} torch thread(s), torch {summary['torch']}, "
         f"Python {summary['python']}, symgraph at `{summary.get('symgraph_commit')}`. Wall time "
         f"{summary['wall_seconds']:.0f} s (training / loading {summary['train_seconds']:.0f} s). Curves: 21-point "
         f"λ grid on {st['curve_batches'] or 'all'} held-out batches; λ=0.5 metric on "
         f"{st['metric_batches'] or 'all'} held-out batches; activation statistics from "
         f"{st['align_batches']} training batches.", "",
         "Regenerate: `python -m benchmarks" + (" --quick" if summary["protocol"] == "quick" else "")
         + (f" --size {st['size']}" if st["size"] != summary["protocol"] else "")
         + (" --seeds " + " ".join(map(str, st["seeds"])) if list(st["seeds"]) != [0, 1, 2] else "")
         + "".join(f" --no-{k}" for k in summary.get("skipped", ())) + "`.", "", "## Models", ""]
    from . import evaluate
    rows = []
    for a in archs:
        rs = _by(records, arch=a, method=methods[0])
        losses = {s: x for r in rs for s, x in zip(r["pair"], (r["loss_a"], r["loss_b"]))}
        mets = {s: x for r in rs for s, x in zip(r["pair"], (r["metric_a"], r["metric_b"]))}
        rows.append([a, rs[0]["metric_name"], mean_sd_cell(mean_sd(list(losses.values()))),
                     mean_sd_cell(mean_sd(list(mets.values()))), f"{evaluate.baseline_loss(a):.3f}"])
    L.append(markdown_table(["arch", "metric", "held-out loss (seeds)", "metric (seeds)", "unigram/prior loss"],
                            rows))
    L += ["", "## Loss barrier (mean ± std over pairs; lower is better)", "",
          "Interpolation methods: `max_λ L(λθ_A + (1−λ)θ_B′) − ½(L_A + L_B)` on the 21-point grid, "
          "with the original B's loss. Fisher / RegMean produce one merged model: their entry is the "
          "midpoint gap `L(merged) − ½(L_A + L_B)`. Best per column in bold.", "", RENAME_NOTE, "",
          _metric_table(records, archs, methods, "barrier", best=min), *targets.section(records, archs),
          "", "## Held-out loss of the merged model (λ = 0.5)", "",
          _metric_table(records, archs, methods, "loss_mid", best=min),
          "", "## Task metric of the merged model (λ = 0.5)", "",
          "Perplexity for the language models (lower is better), accuracy for the ViT (higher is better).", "",
          _metric_table(records, archs, methods, "metric_mid", best=None),
          "", "## Method time (seconds; alignment + merge, no evaluation)", "",
          _metric_table(records, archs, methods, "seconds", best=None, digits=2)]
    soft = [r for r in records if r["method"] == "imfeld2024" and r["kind"] == "interpolation"]
    if soft:
        per_arch = lambda f: ", ".join(  # noqa: E731
            f"{a}: {mean_sd_cell(mean_sd([f(r) for r in soft if r['arch'] == a]))}" for a in archs)
        L += ["", "Soft transport maps (imfeld2024) change B's function: L(B′) − L(B) = "
              + per_arch(lambda r: r["loss_b_aligned"] - r["loss_b"]) + " nats; the barrier measured against "
              "B′'s own endpoint (`barrier_curve`) is " + per_arch(lambda r: r["barrier_curve"]) + "."]
    L += _hetero_section(records) + _speed_section(records, archs) + ["", "## Figures", ""]
    L += [f"- `{f}`" + (f"  \n  ![{f}]({f})" if f.endswith(".png") else "") for f in figures]
    L += ["", "## Methods and deviations from the seeds", "", RENAME_NOTE, ""]
    L += [f"- **{m}** — {METHODS[m][1]}." + (f" *Deviation:* {DEVIATIONS[m]}" if m in DEVIATIONS else "")
          for m in methods]
    L += ["", "Full descriptions: the docstrings of `benchmarks/methods.py`.", "", "## Findings", ""]
    return "\n".join(L + findings(records, archs, methods, summary)) + "\n"


def _metric_table(records, archs, methods, key, best=min, digits=3):
    """Mean ± sd of ``key`` per method and architecture; with ``best``, the best of a column in bold."""
    stats = {(m, a): _stat(records, a, m, key) for m in methods for a in archs}
    bests = {a: best((stats[m, a][0] for m in methods if stats[m, a][0] is not None), default=None)
             for a in archs} if best is not None else {}
    rows = []
    for m in methods:
        cells = {a: mean_sd_cell(stats[m, a], digits) for a in archs}
        rows.append([m] + [f"**{cells[a]}**" if best is not None and stats[m, a][0] == bests[a] else cells[a]
                           for a in archs])
    return markdown_table(["method"] + list(archs), rows)


def _hetero_section(records):
    hs = [r for r in records if r["kind"] == "hetero"]
    if not hs:
        return []
    rows = []
    for m in dict.fromkeys(r["method"] for r in hs):
        rs = [r for r in hs if r["method"] == m]
        rows.append([m, len(rs), *(mean_sd_cell(mean_sd([r[k] for r in rs])) for k in (
            "loss_a", "loss_b", "loss_b_aligned", "loss_mid", "gain_vs_narrow", "metric_a", "metric_mid"))])
    return ["", "## Heterogeneous fusion: `gpt2_wide` (2× MLP) into `gpt2`", "",
            "B (wide) is aligned into A's (narrow) basis and widths (transport maps for the MLP class), "
            "then averaged at λ = 0.5. \"vs narrow alone\" = L(narrow) − L(merged): positive means the "
            "fused model beats the narrow model trained alone.", "",
            markdown_table(["method", "pairs", "L(narrow)", "L(wide)", "L(wide→narrow width)", "L(merged)",
                            "vs narrow alone", "ppl(narrow)", "ppl(merged)"], rows)]


def _speed_section(records, archs):
    """The speed rows of this run, then the committed BERT-base align and 8B analyze measurements."""
    sp = [r for r in records if r["kind"] == "speed"]
    L = ["", "## Speed and memory", ""]
    if sp:
        rows = []
        for a in archs:
            d = {r["method"]: r for r in sp if r["arch"] == a}
            if d:
                det = d["analyze"]["detail"]
                steps = ("analyze", "align_weights", "align_activations")
                rows.append([a, f"{det['parameters']:,}", det["groups"], *(f"{d[s]['seconds']:.2f}" for s in steps),
                             *(f"{d[s]['peak_rss_mb']:.0f}" for s in steps)])
        L += ["Each architecture measured in a fresh process (two trained models of this run): "
              "peak resident set during the step (sampled every ms) above the resident set after "
              "loading both models; analyze columns cover both models, the time column one.", "",
              markdown_table(["arch", "params", "groups", "analyze s (one model)", "align s (weights)",
                              "align s (activations)", "peak MB analyze (both)", "peak MB align(w)",
                              "peak MB align(act)"], rows)]
    for path in sorted(glob.glob(str(RESULTS_DIR / "align_bert_base*.json"))):
        # records written before the seed methods were named after their papers say seed003
        d = {k.replace("seed003", "zhang2025"): v for k, v in json.loads(Path(path).read_text()).items()}
        L += ["", f"**BERT-base-shaped align** (`benchmarks/results/{os.path.basename(path)}`): {d.get('config')}; "
              f"align {d['align_seconds']:.1f} s (solver share {d['align_solver_share']:.0%}, {d.get('sweeps')} "
              f"sweeps) vs a plain Zhang et al. 2024 matching {d['zhang2025_seconds']:.1f} s (ratio "
              f"{d['ratio_align_over_zhang2025']:.2f}×); peak RSS {d['peak_rss_mb']:.0f} MB = "
              f"{d['peak_over_weights']:.1f}× the two models' weights; exact-recovery error "
              f"{d['recovery_max_rel_error']:.1e}."]
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


def _listed(means: dict) -> str:
    return ", ".join(f"`{m}` {x:.3f}" for m, x in sorted(means.items(), key=lambda t: t[1]))


def findings(records, archs, methods, summary) -> list[str]:
    """Plain statements computed from the numbers (regenerated with the report)."""
    F, beats = [], []

    def mean(a, m, k="barrier"):
        return _stat(records, a, m, k)[0]

    def means(a, names, k="barrier"):
        return {m: x for m in names if (x := mean(a, m, k)) is not None}
    for a in archs:
        v, sym = mean(a, "vanilla"), means(a, [m for m in SYMGRAPH_METHODS if m in methods])
        if v is None or not sym:
            continue
        bm = min(sym, key=sym.get)
        beats.append(sym[bm] < v)
        van = {tuple(r["pair"]): r["barrier"] for r in _by(records, arch=a, method="vanilla")}
        got = {tuple(r["pair"]): r["barrier"] for r in _by(records, arch=a, method=bm)}
        F.append(f"- **{a}**: vanilla barrier {v:.3f}; best symgraph method `{bm}` {sym[bm]:.3f} "
                 f"({'lower' if beats[-1] else 'NOT lower'} than vanilla by {v - sym[bm]:+.3f}; lower on "
                 f"{sum(got[p] < van[p] for p in got if p in van)}/{len(got)} pairs).")
        seeds = means(a, [m for m in methods if m in SEED_METHODS])
        better = {m: x for m, x in seeds.items() if x < sym[bm]}
        if better:
            F.append(f"  - A seed method beats symgraph's best here: {_listed(better)}.")
        for sm, sx in sorted(sym.items()):
            worse = {m: x for m, x in seeds.items() if x < sx and m not in better}
            if sm != bm and worse:
                F.append(f"  - Seed methods with a lower barrier than `{sm}` ({sx:.3f}): {_listed(worse)}.")
        allm = means(a, methods)
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
        vals = means(a, methods, "metric_mid")
        if not vals:
            continue
        pick = max if evaluate.higher_is_better(a) else min
        top, syms = pick(vals, key=vals.get), {m: vals[m] for m in SYMGRAPH_METHODS if m in vals}
        line = (f"- Merged-model {evaluate.metric_name(a)} on {a} (λ = 0.5): best `{top}` {vals[top]:.3f}, vanilla "
                f"{vals.get('vanilla', float('nan')):.3f}")
        if syms:
            bs = pick(syms, key=syms.get)
            line += f", best symgraph `{bs}` {syms[bs]:.3f}"
        F.append(line + (" — a seed method has the best merged model here" if top in SEED_METHODS else "") + ".")
    s3, s3r = [], []
    for a in archs:
        x, v, y = mean(a, "zhang2025"), mean(a, "vanilla"), mean(a, "zhang2025_rescale")
        sym = min(means(a, SYMGRAPH_METHODS).values(), default=None)
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
        F.append("- `zhang2025`'s scalar rescaling (`zhang2025_rescale`) changes the mean barrier by "
                 + ", ".join(s3r) + " nats.")
    for base in ("fisher", "regmean"):
        gaps = {a: (mean(a, base), mean(a, base + "_aligned")) for a in archs}
        gaps = {a: xy for a, xy in gaps.items() if None not in xy}
        hurt = [a for a, (x, y) in gaps.items() if y > x]
        if gaps:
            F.append(f"- {base.capitalize()} midpoint gap without → with symgraph alignment: "
                     + "; ".join(f"{a} {x:.3f} → {y:.3f}" for a, (x, y) in gaps.items()) + "."
                     + (f" Alignment makes it worse on {', '.join(hurt)}." if hurt else ""))
    soft = [r for r in records if r["method"] == "imfeld2024" and r["kind"] == "interpolation"]
    if soft:
        parts = []
        for a in archs:
            mid, sym = mean(a, "imfeld2024", "loss_mid"), mean(a, "symgraph_activations", "loss_mid")
            if mid is not None and sym is not None:
                parts.append(f"{a} L(0.5) {mid:.3f} vs symgraph_activations {sym:.3f} "
                             f"(barrier {mean(a, 'imfeld2024'):.3f})")
        rise = mean_sd([r["loss_b_aligned"] - r["loss_b"] for r in soft])[0]
        F.append(f"- `imfeld2024`'s soft maps are not symmetries: B′ is a different function (L(B′) − L(B) = "
                 f"{rise:+.3f} nats on average), so its barrier against the original endpoints includes "
                 "that loss; midpoints: " + "; ".join(parts) + ".")
    hs = [r for r in records if r["kind"] == "hetero"]
    if hs:
        gains = {m: mean_sd([r["gain_vs_narrow"] for r in hs if r["method"] == m])[0] for m in
                 dict.fromkeys(r["method"] for r in hs)}
        F.append("- Heterogeneous fusion (wide → narrow, then average): " + "; ".join(
            f"`{m}` {'beats' if g > 0 else 'does not beat'} the narrow model alone ({g:+.3f} nats)"
            for m, g in gains.items()) + ".")
    hm = summary.get("heatmap")
    if hm:
        F.append(f"- Attention-output correlation at `{hm['module']}`: mean diagonal {hm['diag_before']:.2f} "
                 f"before alignment, {hm['diag_after']:.2f} after (symgraph, activations).")
    return F

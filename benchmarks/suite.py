"""The benchmark suite: every merging method on every seed pair of locally trained models.

``python -m benchmarks [suite] [--quick] [--out DIR] [--archs ...] [--pairs N]`` (the runner,
:mod:`benchmarks.__main__`, runs the suite when no benchmark is named)

1. trains (or loads from ``$SYMGRAPH_CACHE``) ``--seeds`` models per architecture, plus the
   wide GPT-2 for heterogeneous fusion;
2. runs every method of :mod:`benchmarks.methods` on every seed pair: interpolation methods
   get a 21-point loss curve ``λθ_A + (1−λ)θ_B'`` (λ=1 is A), merged-model methods
   (Fisher, RegMean) one merged model;
3. fuses the wide GPT-2 into the narrow one and compares with the narrow model alone;
   fine-tunes fused models against their parents (:mod:`benchmarks.bench_finetune`) and
   merges N = 3 (quick) or 3-5 models per architecture into an anchor's basis vs a shared
   universe (:mod:`benchmarks.bench_universe`); interpolates pairs of BatchNorm CNNs trained
   on the digits, vanilla / weight / activation matching, each with and without REPAIR
   (BatchNorm statistics reset; :mod:`benchmarks.bench_cnn`);
4. measures analyze / align time and peak memory per architecture in fresh processes;
5. writes ``results.json``, ``report.md`` and PNG plots into ``--out`` (built in a temporary
   directory, then each file is moved into place).

Barrier: ``max_λ L(λ) − ½(L(θ_A) + L(θ_B))`` over the curve, with the *original* B's loss in
the mean (for exact alignments L(θ_B') = L(θ_B); soft transport maps change B's function, and
``barrier_curve`` gives the curve's own endpoint version, ``symgraph.loss_barrier``). For
Fisher / RegMean the barrier is the midpoint gap ``L(merged) − ½(L_A + L_B)``.

``--quick`` (what a reviewer runs first): quick-size models, 3 seeds, curves on 4 held-out
batches. Default (full): full-size models, every pair, all held-out batches; ``--size quick``
runs the full protocol on quick-size models.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from .harness import machine_info, script
from .provenance import REPO_ROOT, git_state, log, register, staged, write_json

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Settings:
    """What a run does; ``quick`` and ``full`` differ only in these numbers."""
    size: str
    seeds: tuple
    pairs: int | None          # seed pairs per architecture (None: all)
    curve_batches: int | None  # held-out batches per curve point (None: all)
    metric_batches: int | None  # held-out batches for the λ=0.5 metric (None: all)
    align_batches: int         # training-split batches for activation statistics
    steps: int | None = None   # training steps override (tests)
    hetero_pairs: int | None = None


def settings_for(quick: bool, size=None, seeds=None, pairs=None, steps=None) -> Settings:
    seeds = tuple(seeds) if seeds else (0, 1, 2)
    if quick:
        return Settings(size or "quick", seeds, pairs, curve_batches=4, metric_batches=None,
                        align_batches=4, steps=steps, hetero_pairs=1 if pairs is None else pairs)
    return Settings(size or "full", seeds, pairs, curve_batches=None, metric_batches=None,
                    align_batches=8, steps=steps, hetero_pairs=pairs)


# --- evaluation of one outcome ---------------------------------------------------------------


def evaluate_outcome(a, b, out, loss_fn, metric_fn, loss_a, loss_b, lambdas):
    """Curve, barrier and λ=0.5 numbers of one method's outcome (a dict for the record)."""
    import symgraph
    t = time.perf_counter()
    if out.b_aligned is not None:
        curve = symgraph.interpolate(a, out.b_aligned, lambdas=lambdas, loss_fn=loss_fn)
        losses = [l for _, l in curve]
        barrier = max(losses) - 0.5 * (loss_a + loss_b)
        mid = copy_mid(a, out.b_aligned)
        rec = {"kind": "interpolation", "curve": curve, "barrier": barrier,
               "barrier_curve": symgraph.loss_barrier(curve),
               "loss_b_aligned": curve[0][1], "loss_mid": dict(curve)[0.5]}
    else:
        mid = out.merged
        loss_mid = loss_fn(mid)
        rec = {"kind": "merged", "curve": None, "barrier": loss_mid - 0.5 * (loss_a + loss_b),
               "barrier_curve": None, "loss_b_aligned": None, "loss_mid": loss_mid}
    rec["metric_mid"] = metric_fn(mid)
    rec["eval_seconds"] = time.perf_counter() - t
    return rec


def copy_mid(a, b):
    """The λ=0.5 model ½(θ_A + θ_B)."""
    import copy
    m = copy.deepcopy(a)
    pb = dict(b.named_parameters())
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(0.5 * p + 0.5 * pb[k])
    return m


# --- the run ----------------------------------------------------------------------------------


def _hetero_pairs(st: Settings):
    """(narrow seed, wide seed) pairs: different seeds, so no layer shares its initialisation."""
    n = len(st.seeds)
    pairs = [(st.seeds[i], st.seeds[(i + 1) % n]) for i in range(n)]
    return pairs if st.hetero_pairs is None else pairs[: st.hetero_pairs]


def _train_all(st: Settings, archs, hetero: bool):
    from . import train
    jobs = [(arch, seed) for arch in archs for seed in st.seeds]
    if hetero:
        jobs += [("gpt2_wide", s) for s in sorted({b for _, b in _hetero_pairs(st)})]
    t = time.perf_counter()
    for arch, seed in jobs:
        cached = train.is_cached(arch, seed, st.size, st.steps)
        t1 = time.perf_counter()
        train.train_model(arch, seed, st.size, st.steps)
        if not cached:
            log(f"  trained {arch} seed {seed} in {time.perf_counter() - t1:.1f}s")
    return time.perf_counter() - t


def _pairs(st: Settings):
    ps = list(itertools.combinations(st.seeds, 2))
    return ps if st.pairs is None else ps[: st.pairs]


def run_methods(st: Settings, arch: str, method_names, lambdas):
    """Every method on every pair of ``arch``; returns (records, context for plots)."""
    import symgraph

    from . import evaluate, methods, speed, train
    models = {s: train.train_model(arch, s, st.size, st.steps) for s in st.seeds}
    data = speed.alignment_data(arch, st.align_batches)
    reports, an_s = {}, {}
    for s, m in models.items():
        t = time.perf_counter()
        reports[s] = symgraph.analyze(m, data[0])
        an_s[s] = time.perf_counter() - t
    loss_fn = evaluate.loss_fn_for(arch, max_batches=st.curve_batches)
    metric_fn = lambda m: evaluate.eval_metric(m, arch, max_batches=st.metric_batches)  # noqa: E731
    loss = {s: loss_fn(m) for s, m in models.items()}
    metric = {s: metric_fn(m) for s, m in models.items()}
    records, keep = [], {}
    for sa, sb in _pairs(st):
        p = methods.Pair(arch, models[sa], models[sb], data, reports[sa], reports[sb])
        for name in method_names:
            fn = methods.METHODS[name][0]
            out = fn(p)
            rec = {"arch": arch, "method": name, "pair": [sa, sb], "size": st.size,
                   "loss_a": loss[sa], "loss_b": loss[sb],
                   "metric_name": evaluate.metric_name(arch), "metric_a": metric[sa], "metric_b": metric[sb],
                   "seconds": out.seconds, "align_seconds": out.align_seconds,
                   "analyze_seconds": an_s[sa] + an_s[sb], "peak_rss_mb": None}
            rec.update(evaluate_outcome(p.a, p.b, out, loss_fn, metric_fn, loss[sa], loss[sb], lambdas))
            if out.extra:
                rec["extra"] = out.extra
            records.append(rec)
            log(f"  {arch} {sa}-{sb} {name:<22} barrier {rec['barrier']:7.3f}  "
                f"L(0.5) {rec['loss_mid']:.3f}  {out.seconds:5.2f}s")
            if (sa, sb) == _pairs(st)[0] and name == "symgraph_activations":
                keep = {"pair": p, "b_aligned": out.b_aligned}
    return records, keep


def run_hetero(st: Settings, lambdas):
    """Fuse ``gpt2_wide`` (2x MLP) into ``gpt2``; compare with the narrow model alone."""
    import symgraph

    from . import evaluate, methods, speed, train
    narrow, wide = "gpt2", "gpt2_wide"
    data = speed.alignment_data(narrow, st.align_batches)
    loss_fn = evaluate.loss_fn_for(narrow, max_batches=st.curve_batches)
    metric_fn = lambda m: evaluate.eval_metric(m, narrow, max_batches=st.metric_batches)  # noqa: E731
    records = []
    for sa, sb in _hetero_pairs(st):
        a = train.train_model(narrow, sa, st.size, st.steps)
        b = train.train_model(wide, sb, st.size, st.steps)
        ra, rb = symgraph.analyze(a, data[0]), symgraph.analyze(b, data[0])
        p = methods.Pair(narrow, a, b, data, ra, rb)
        la, lb = loss_fn(a), loss_fn(b)
        ma, mb = metric_fn(a), metric_fn(b)
        for name in ("symgraph_weights", "symgraph_activations", "imfeld2024"):
            out = methods.METHODS[name][0](p)
            rec = {"arch": "gpt2_wide->gpt2", "method": name, "pair": [sa, sb], "size": st.size,
                   "loss_a": la, "loss_b": lb, "metric_name": evaluate.metric_name(narrow),
                   "metric_a": ma, "metric_b": mb, "seconds": out.seconds,
                   "align_seconds": out.align_seconds, "analyze_seconds": None, "peak_rss_mb": None}
            rec.update(evaluate_outcome(a, b, out, loss_fn, metric_fn, la, lb, lambdas))
            rec["kind"] = "hetero"
            rec["metric_b_aligned"] = metric_fn(out.b_aligned)
            rec["gain_vs_narrow"] = la - rec["loss_mid"]
            records.append(rec)
            log(f"  hetero {sa}-{sb} {name:<22} L(narrow) {la:.3f} L(wide) {lb:.3f} "
                f"L(wide→narrow) {rec['loss_b_aligned']:.3f} L(0.5) {rec['loss_mid']:.3f}")
    return records


def run_speed(st: Settings, arch: str) -> dict:
    """Analyze / align time and peak RSS of ``arch`` in a fresh process."""
    cmd = [sys.executable, "-m", "benchmarks.speed", arch, "--size", st.size,
           "--seeds", str(st.seeds[0]), str(st.seeds[1]), "--batches", str(st.align_batches)]
    if st.steps is not None:
        cmd += ["--steps", str(st.steps)]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(out: str, quick: bool = False, archs=None, pairs=None, size=None, seeds=None,
        steps=None, method_names=None, speed: bool = True, hetero: bool = True,
        finetune: bool = True, universe: bool = True, cnn: bool = True) -> dict:
    """Run the suite and write its outputs into ``out``; returns the summary dict."""
    from . import train, zoo
    from .methods import METHODS
    t_start = time.perf_counter()
    torch.set_num_threads(train.num_threads())
    archs = tuple(archs or zoo.ARCHS)
    st = settings_for(quick, size, seeds, pairs, steps)
    if len(st.seeds) < 2:
        raise SystemExit("need at least 2 seeds to form a pair")
    method_names = list(method_names or METHODS)
    skipped = [k for k, on in (("speed", speed), ("hetero", hetero), ("finetune", finetune),
                               ("universe", universe), ("cnn", cnn)) if not on]  # as asked
    hetero = hetero and "gpt2" in archs
    lambdas = np.linspace(0.0, 1.0, 21).round(4)
    log(f"symgraph benchmark suite: {'quick' if quick else 'full'} protocol, size={st.size}, "
        f"seeds={st.seeds}, archs={archs}, threads={torch.get_num_threads()}")
    log("training / loading models ...")
    train_s = _train_all(st, archs, hetero)
    records, keep = [], {}
    for arch in archs:
        log(f"methods on {arch} ...")
        recs, k = run_methods(st, arch, method_names, lambdas)
        records += recs
        keep[arch] = k
    if hetero:
        log("heterogeneous fusion ...")
        records += run_hetero(st, lambdas)
    sections = {}
    if finetune and hetero:
        from . import bench_finetune
        log("fine-tune after fusion ...")
        sections["finetune"] = (bench_finetune, bench_finetune.run(
            st.size, steps=st.steps, K=10 if st.steps else None, eval_every=5 if st.steps else None,
            eval_batches=st.curve_batches))
    if universe:
        from . import bench_universe
        log("N models: anchor vs universe ...")
        sections["universe"] = (bench_universe, bench_universe.run(
            st.size, archs, n_models=(3,) if quick else (3, 4, 5), steps=st.steps,
            eval_batches=st.curve_batches))
    if cnn:
        from . import bench_cnn
        cnn = st.size in bench_cnn.WIDTHS
        if not cnn:
            log(f"BatchNorm CNNs: no {st.size!r} size (sizes: {', '.join(bench_cnn.WIDTHS)}); skipped")
    if cnn:
        log("BatchNorm CNNs: alignment and REPAIR ...")
        sections["cnn"] = (bench_cnn, bench_cnn.run(st.size, st.seeds, st.pairs, st.steps))
    if speed:
        log("speed rows ...")
        for arch in archs:
            s = run_speed(st, arch)
            for m, sec, mem in (("analyze", s["analyze_seconds"], s["peak_rss_analyze_mb"]),
                                ("align_weights", s["align_weights_seconds"], s["peak_rss_align_weights_mb"]),
                                ("align_activations", s["align_activations_seconds"],
                                 s["peak_rss_align_activations_mb"])):
                records.append({"arch": arch, "method": m, "kind": "speed", "pair": s["seeds"],
                                "size": st.size, "barrier": None, "metric_mid": None, "seconds": sec,
                                "peak_rss_mb": mem, "detail": s})
    summary = {"protocol": "quick" if quick else "full", "settings": st.__dict__ | {"seeds": list(st.seeds)},
               "archs": list(archs), "methods": method_names, "train_seconds": train_s,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "python": platform.python_version(), "cache": str(_cache_root()), "machine": machine_info(),
               "symgraph_commit": git_state(),
               "skipped": skipped}
    with staged(out) as tmp:
        from . import report as rep
        figures = rep.plots(tmp, records, keep, archs)
        more = []
        for name, (mod, res) in sections.items():
            figures += mod.plot(res, tmp)
            write_json(tmp / f"{name}.json", res)
            more.append(_demote(mod.markdown(res)))
        summary["wall_seconds"] = time.perf_counter() - t_start
        summary["figures"] = figures
        summary["heatmap"] = next((k["heatmap"] for k in keep.values() if k and "heatmap" in k), None)
        write_json(tmp / "results.json", records)
        (tmp / "report.md").write_text("\n\n".join([rep.markdown(records, summary, figures)] + more))
        written = [f.name for f in tmp.iterdir()]
    register(out, written)
    log(f"wrote {out}/results.json, report.md and {len(figures)} figures in "
        f"{time.perf_counter() - t_start:.0f}s")
    return summary




def _demote(md: str) -> str:
    """A stand-alone report as a section of the suite's: every heading one level down."""
    return "\n".join("#" + line if line.startswith("#") else line for line in md.splitlines())


def _cache_root():
    from . import data
    return data.cache_dir()


def main(argv=None) -> None:
    from . import zoo
    from .methods import METHODS
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="quick protocol (< ~15 min on 2 cores)")
    ap.add_argument("--out", default=None, help="output directory (default: benchmarks/results/suite, "
                    "or bench-quick with --quick)")
    ap.add_argument("--archs", nargs="+", choices=zoo.ARCHS + zoo.MOE_ARCHS + zoo.VARIANT_ARCHS,
                    default=None, help=f"architectures (default: {' '.join(zoo.ARCHS)}; on request: "
                    f"{' '.join(zoo.MOE_ARCHS)} (mixture of experts), {' '.join(zoo.VARIANT_ARCHS)})")
    ap.add_argument("--pairs", type=int, default=None, help="seed pairs per architecture (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2)")
    ap.add_argument("--size", choices=zoo.SIZES, default=None,
                    help="model size (default: quick with --quick, else full)")
    ap.add_argument("--steps", type=int, default=None, help="override training steps (tests)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    ap.add_argument("--no-speed", action="store_true", help="skip the speed rows")
    ap.add_argument("--no-hetero", action="store_true", help="skip heterogeneous fusion (and "
                    "fine-tuning after fusion)")
    ap.add_argument("--no-finetune", action="store_true", help="skip fine-tuning after fusion")
    ap.add_argument("--no-universe", action="store_true", help="skip N-model merging (anchor vs "
                    "universe)")
    ap.add_argument("--no-cnn", action="store_true", help="skip the BatchNorm CNN pairs (alignment "
                    "and REPAIR on the digits)")
    a = ap.parse_args(argv)
    out = a.out or ("bench-quick" if a.quick else str(RESULTS_DIR / "suite"))
    run(out, a.quick, a.archs, a.pairs, a.size, a.seeds, a.steps, a.methods,
        speed=not a.no_speed, hetero=not a.no_hetero, finetune=not a.no_finetune,
        universe=not a.no_universe, cnn=not a.no_cnn)


if __name__ == "__main__":
    script(main)

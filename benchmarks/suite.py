"""The benchmark suite: every merging method on every seed pair of locally trained models.

``python -m benchmarks [suite] [--quick] [--out DIR] [--archs ...] [--pairs N]`` trains (or loads
from ``$SYMGRAPH_CACHE``) ``--seeds`` models per architecture; runs every method of
:mod:`benchmarks.methods` on every seed pair (interpolation methods: a 21-point loss curve
``λθ_A + (1−λ)θ_B'``, λ=1 is A; merged-model methods: one merged model); fuses the wide GPT-2
into the narrow one; runs :mod:`benchmarks.bench_finetune`, :mod:`benchmarks.bench_universe` (N = 3
with ``--quick``, else 3-5) and :mod:`benchmarks.bench_cnn` as sections; measures analyze / align
time and peak memory per architecture in fresh processes; writes ``results.json``, ``report.md``
and PNG plots into ``--out``.

Barrier: ``max_λ L(λ) − ½(L(θ_A) + L(θ_B))`` over the curve, with the *original* B's loss in
the mean (for exact alignments L(θ_B') = L(θ_B); soft transport maps change B's function, and
``barrier_curve`` gives the curve's own endpoint version, ``symgraph.loss_barrier``). For
merged models the barrier is the midpoint gap ``L(merged) − ½(L_A + L_B)``.

``--quick``: quick-size models, 3 seeds, curves on 4 held-out batches. Default (full):
full-size models, every pair, all held-out batches; ``--size quick`` runs the full protocol on
quick-size models.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

import symgraph

from . import bench_cnn, bench_finetune, bench_universe, data, evaluate, methods, report, speed, train, zoo
from .harness import machine_info, script
from .provenance import REPO_ROOT, git_state, log, write_json, write_result

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def settings_for(quick: bool, size=None, seeds=None, pairs=None, steps=None) -> SimpleNamespace:
    """What a run does (None: all): seed ``pairs`` per architecture, held-out batches per curve point
    (``curve_batches``) and for the λ=0.5 metric (``metric_batches``), training-split batches for
    activation statistics (``align_batches``), the training ``steps`` (tests), ``hetero_pairs``."""
    return SimpleNamespace(size=size or ("quick" if quick else "full"), seeds=tuple(seeds) if seeds else (0, 1, 2),
                           pairs=pairs, curve_batches=4 if quick else None, metric_batches=None,
                           align_batches=4 if quick else 8, steps=steps,
                           hetero_pairs=(1 if pairs is None else pairs) if quick else pairs)


def copy_mid(a, b):
    """The λ=0.5 model ½(θ_A + θ_B)."""
    m = copy.deepcopy(a)
    pb = dict(b.named_parameters())
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(0.5 * p + 0.5 * pb[k])
    return m


def _hetero_pairs(st):
    """(narrow seed, wide seed) pairs: different seeds, so no layer shares its initialisation."""
    n = len(st.seeds)
    pairs = [(st.seeds[i], st.seeds[(i + 1) % n]) for i in range(n)]
    return pairs if st.hetero_pairs is None else pairs[: st.hetero_pairs]


def _pairs(st):
    ps = list(itertools.combinations(st.seeds, 2))
    return ps if st.pairs is None else ps[: st.pairs]


def _train_all(st, archs, hetero: bool):
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


def _scorers(st, arch: str):
    """``(loss_fn, metric_fn)`` of ``arch`` on the settings' held-out batches."""
    return (evaluate.loss_fn_for(arch, max_batches=st.curve_batches),
            lambda m: evaluate.eval_metric(m, arch, max_batches=st.metric_batches))


def _method_record(st, label: str, name: str, p, seeds, losses, metrics, scorers, lambdas):
    """One method's outcome on the pair ``p`` and its record (``label``: the record's arch): the
    curve, barrier and λ=0.5 numbers."""
    out = methods.METHODS[name][0](p)
    rec = {"arch": label, "method": name, "pair": list(seeds), "size": st.size, "loss_a": losses[0],
           "loss_b": losses[1], "metric_name": evaluate.metric_name(p.arch), "metric_a": metrics[0],
           "metric_b": metrics[1], "seconds": out.seconds, "align_seconds": out.align_seconds,
           "analyze_seconds": None, "peak_rss_mb": None}
    t = time.perf_counter()
    parents = 0.5 * (losses[0] + losses[1])
    if out.b_aligned is not None:
        curve = symgraph.interpolate(p.a, out.b_aligned, lambdas=lambdas, loss_fn=scorers[0])
        mid = copy_mid(p.a, out.b_aligned)
        rec |= {"kind": "interpolation", "curve": curve, "barrier": max(l for _, l in curve) - parents,
                "barrier_curve": symgraph.loss_barrier(curve), "loss_b_aligned": curve[0][1],
                "loss_mid": dict(curve)[0.5]}
    else:
        mid = out.merged
        loss_mid = scorers[0](mid)
        rec |= {"kind": "merged", "curve": None, "barrier": loss_mid - parents, "barrier_curve": None,
                "loss_b_aligned": None, "loss_mid": loss_mid}
    rec |= {"metric_mid": scorers[1](mid), "eval_seconds": time.perf_counter() - t}
    return out, rec


def run_methods(st, arch: str, method_names, lambdas):
    """Every method on every pair of ``arch``; returns (records, context for plots)."""
    models = {s: train.train_model(arch, s, st.size, st.steps) for s in st.seeds}
    data = speed.alignment_data(arch, st.align_batches)
    reports, an_s = {}, {}
    for s, m in models.items():
        t = time.perf_counter()
        reports[s] = symgraph.analyze(m, data[0])
        an_s[s] = time.perf_counter() - t
    scorers = _scorers(st, arch)
    loss = {s: scorers[0](m) for s, m in models.items()}
    metric = {s: scorers[1](m) for s, m in models.items()}
    records, keep = [], {}
    for sa, sb in _pairs(st):
        p = methods.Pair(arch, models[sa], models[sb], data, reports[sa], reports[sb])
        for name in method_names:
            out, rec = _method_record(st, arch, name, p, (sa, sb), (loss[sa], loss[sb]), (metric[sa], metric[sb]),
                                      scorers, lambdas)
            rec["analyze_seconds"] = an_s[sa] + an_s[sb]
            if out.extra:
                rec["extra"] = out.extra
            records.append(rec)
            log(f"  {arch} {sa}-{sb} {name:<22} barrier {rec['barrier']:7.3f}  "
                f"L(0.5) {rec['loss_mid']:.3f}  {out.seconds:5.2f}s")
            if (sa, sb) == _pairs(st)[0] and name == "symgraph_activations":
                keep = {"pair": p, "b_aligned": out.b_aligned}
    return records, keep


def run_hetero(st, lambdas):
    """Fuse ``gpt2_wide`` (2x MLP) into ``gpt2``; compare with the narrow model alone."""
    data = speed.alignment_data("gpt2", st.align_batches)
    scorers = _scorers(st, "gpt2")
    records = []
    for sa, sb in _hetero_pairs(st):
        a, b = train.train_model("gpt2", sa, st.size, st.steps), train.train_model("gpt2_wide", sb, st.size, st.steps)
        p = methods.Pair("gpt2", a, b, data, symgraph.analyze(a, data[0]), symgraph.analyze(b, data[0]))
        losses, metrics = (scorers[0](a), scorers[0](b)), (scorers[1](a), scorers[1](b))
        for name in ("symgraph_weights", "symgraph_activations", "imfeld2024"):
            out, rec = _method_record(st, "gpt2_wide->gpt2", name, p, (sa, sb), losses, metrics, scorers, lambdas)
            rec["kind"] = "hetero"
            rec["metric_b_aligned"] = scorers[1](out.b_aligned)
            rec["gain_vs_narrow"] = losses[0] - rec["loss_mid"]
            records.append(rec)
            log(f"  hetero {sa}-{sb} {name:<22} L(narrow) {losses[0]:.3f} L(wide) {losses[1]:.3f} "
                f"L(wide→narrow) {rec['loss_b_aligned']:.3f} L(0.5) {rec['loss_mid']:.3f}")
    return records


def run(out: str, quick: bool = False, archs=None, pairs=None, size=None, seeds=None,
        steps=None, method_names=None, speed: bool = True, hetero: bool = True,
        finetune: bool = True, universe: bool = True, cnn: bool = True) -> dict:
    """Run the suite and write its outputs into ``out``; returns the summary dict."""
    t_start = time.perf_counter()
    torch.set_num_threads(train.num_threads())
    archs = tuple(archs or zoo.ARCHS)
    st = settings_for(quick, size, seeds, pairs, steps)
    if len(st.seeds) < 2:
        raise SystemExit("need at least 2 seeds to form a pair")
    method_names = list(method_names or methods.METHODS)
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
        recs, keep[arch] = run_methods(st, arch, method_names, lambdas)
        records += recs
    if hetero:
        log("heterogeneous fusion ...")
        records += run_hetero(st, lambdas)
    sections = {}
    if finetune and hetero:
        log("fine-tune after fusion ...")
        sections["finetune"] = (bench_finetune, bench_finetune.run(
            st.size, steps=st.steps, K=10 if st.steps else None, eval_every=5 if st.steps else None,
            eval_batches=st.curve_batches))
    if universe:
        log("N models: anchor vs universe ...")
        sections["universe"] = (bench_universe, bench_universe.run(
            st.size, archs, n_models=(3,) if quick else (3, 4, 5), steps=st.steps,
            eval_batches=st.curve_batches))
    if cnn:
        if st.size in bench_cnn.WIDTHS:
            log("BatchNorm CNNs: alignment and REPAIR ...")
            sections["cnn"] = (bench_cnn, bench_cnn.run(st.size, st.seeds, st.pairs, st.steps))
        else:
            log(f"BatchNorm CNNs: no {st.size!r} size (sizes: {', '.join(bench_cnn.WIDTHS)}); skipped")
    if speed:
        log("speed rows ...")
        for arch in archs:  # in a fresh process each
            cmd = [sys.executable, "-m", "benchmarks.speed", arch, "--size", st.size, "--seeds", str(st.seeds[0]),
                   str(st.seeds[1]), "--batches", str(st.align_batches)]
            cmd += ["--steps", str(st.steps)] if st.steps is not None else []
            res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
            s = json.loads(res.stdout.strip().splitlines()[-1])
            for m in ("analyze", "align_weights", "align_activations"):
                records.append({"arch": arch, "method": m, "kind": "speed", "pair": s["seeds"],
                                "size": st.size, "barrier": None, "metric_mid": None, "seconds": s[f"{m}_seconds"],
                                "peak_rss_mb": s[f"peak_rss_{m}_mb"], "detail": s})
    summary = {"protocol": "quick" if quick else "full", "settings": st.__dict__ | {"seeds": list(st.seeds)},
               "archs": list(archs), "methods": method_names, "train_seconds": train_s,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "python": platform.python_version(), "cache": str(data.cache_dir()), "machine": machine_info(),
               "symgraph_commit": git_state(), "skipped": skipped}

    def figures(records, tmp):  # the suite's figures, each section's JSON and figures
        summary["figures"] = report.plots(tmp, records, keep, archs)
        for name, (mod, res) in sections.items():
            summary["figures"] += mod.plot(res, tmp)
            write_json(tmp / f"{name}.json", res)
        summary["wall_seconds"] = time.perf_counter() - t_start
        summary["heatmap"] = next((k["heatmap"] for k in keep.values() if k and "heatmap" in k), None)

    def markdown(records):  # then each section's report, every heading one level down
        return "\n\n".join([report.markdown(records, summary, summary["figures"])] + [
            "\n".join("#" + ln if ln.startswith("#") else ln for ln in mod.markdown(res).splitlines())
            for mod, res in sections.values()])

    write_result(out, ".bench-", records, markdown, figures)
    log(f"wrote {out}/results.json, report.md and {len(summary['figures'])} figures in "
        f"{time.perf_counter() - t_start:.0f}s")
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="quick protocol (< ~15 min on 2 cores)")
    ap.add_argument("--out", default=None, help="output directory (default: benchmarks/results/suite, "
                    "or bench-quick with --quick)")
    ap.add_argument("--archs", nargs="+", choices=zoo.ARCHS + zoo.MOE_ARCHS + zoo.VARIANT_ARCHS,
                    default=None, help=f"architectures (default: {' '.join(zoo.ARCHS)})")
    ap.add_argument("--pairs", type=int, default=None, help="seed pairs per architecture (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2)")
    ap.add_argument("--size", choices=zoo.SIZES, default=None,
                    help="model size (default: quick with --quick, else full)")
    ap.add_argument("--steps", type=int, default=None, help="override training steps (tests)")
    ap.add_argument("--methods", nargs="+", choices=list(methods.METHODS), default=None)
    for part, what in (("speed", "the speed rows"), ("hetero", "heterogeneous fusion (and fine-tuning after it)"),
                       ("finetune", "fine-tuning after fusion"), ("universe", "N-model merging"),
                       ("cnn", "the BatchNorm CNN pairs")):
        ap.add_argument(f"--no-{part}", action="store_true", help=f"skip {what}")
    a = ap.parse_args(argv)
    out = a.out or ("bench-quick" if a.quick else str(RESULTS_DIR / "suite"))
    run(out, a.quick, a.archs, a.pairs, a.size, a.seeds, a.steps, a.methods,
        speed=not a.no_speed, hetero=not a.no_hetero, finetune=not a.no_finetune,
        universe=not a.no_universe, cnn=not a.no_cnn)


if __name__ == "__main__":
    script(main)

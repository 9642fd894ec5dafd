"""Out of core on an accelerator: ``symgraph merge A B --align weights --device DEV`` on a
LLaMA-shaped bf16 pair read from disk, against the unaligned merge (``--align none``) of the
same pair on the same device in the same process, by depth.

For each depth :mod:`benchmarks.bench_scale`'s writer puts a pair under ``--work`` (its shards by
``--workers`` processes; timed, not counted); then, each as the command runs it
(:func:`symgraph.app.run.run_merge`, ``streaming=True``), in this process: the unaligned merge
(first: a run the outer ``timeout`` stops still leaves the baseline), the aligned merge, and at
the depths of ``--stages`` the aligned merge with :mod:`benchmarks.bench_cost`'s stage counters
(each stage synchronised with the device). A ``tiny`` warm-up merge runs first (timed, not counted).

Per run: wall seconds (no process start, no imports); the engine's timings, the alignment's
(solver seconds, sweeps) and its ledger's peak; the device's peak memory (allocated / reserved);
what :class:`benchmarks.scale.probe.Probe` sees (peak resident set, bytes read and how many
times the pair that is, the devices of the solvers' similarities, the solver calls); the inputs'
share in the page cache just before (``mincore``: with ``--cache asis`` the pair just written is
in RAM; ``cold`` drops it); the output's tensors, shapes and dtype (headers) and, up to
``--load-check-gb`` per model, ``from_pretrained``; the first rows of four tensors (the
unaligned merge against bf16(A/2 + B/2), the aligned one against the unaligned). Outputs and
pairs are deleted once measured. JSON and Markdown are rewritten after every run and every
``--heartbeat`` seconds during one (a run the timeout stops still says what its solves cost).

Measurement switches (the library's defaults unchanged): ``--auction-layers`` adds the run
"aligned, device auction", ``symgraph.solve._solvers.SPARSE_N`` raised past any size for that
run, so that square assignments from ``AUCTION_MIN`` on go to the device auction instead of the
host's sparse LAPJVsp (on the CPU: SciPy's dense solve); ``--skip-aligned`` runs only the
unaligned merge and the ``--methods`` runs.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

from benchmarks.bench_cost import dash, instrument, peaks, stage_rows
from benchmarks.bench_device import device_args, device_of, header
from benchmarks.harness import machine_info, script, sync
from benchmarks.provenance import log, matmul_rates, table, write_entry
from benchmarks.scale.checkpoints import (check_output, drop_cache, ensure_pair, llama_config, model_sizes,
                                          tensor_files, token_data, weight_files)
from benchmarks.scale.probe import Probe, meminfo, resident

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "device" / "disk.json"
DEFAULT_WORK = "/tmp/symgraph-device-disk"
GB = 1e9
SAMPLES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.mlp.gate_proj.weight", "lm_head.weight")
ROWS = 8  # rows of each sample tensor compared


def samples(path) -> dict:
    """The first :data:`ROWS` rows of each of :data:`SAMPLES` (float32)."""
    from safetensors import safe_open
    files, out = tensor_files(path), {}
    for k in (k for k in SAMPLES if k in files):
        with safe_open(str(files[k]), framework="pt") as h:
            out[k] = h.get_slice(k)[:ROWS].float()
    return out


def _max_diff(x: dict, y: dict) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def merge_once(pair, device, out, load_check, align="weights", method="average", data=None, budget=None,
               until="gap", auction=False, staged=None, every=0.0, beat=None) -> dict:
    """One ``run_merge`` of the pair into ``out``, measured: ``method`` reading ``data`` where it
    reads data, ``budget`` the engine's memory budget, ``until`` when weight matching's sweeps
    end, ``auction`` the device auction forced, ``staged`` the peaks of the stage counters'
    rates (None: no counters); ``beat(now)`` every ``every`` seconds."""
    from symgraph.app.config import MergeConfig
    from symgraph.app.run import run_merge
    from symgraph.solve import _solvers as SV
    shutil.rmtree(out, ignore_errors=True)
    rec = {"align": align, "method": method, "until": until, "meminfo_before": meminfo(),
           "inputs_in_page_cache": resident([str(f) for m in "ab" for f in weight_files(pair[m])])}
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        rec["gpu_before_gb"] = torch.cuda.memory_allocated(device) / GB
    cfg = MergeConfig(models=[pair["a"], pair["b"]], out=str(out), align=align, device=str(device),
                      memory_budget=budget, method=method, data=data, until=until)
    with contextlib.ExitStack() as stack:  # left in reverse: the probe, the switch, the counters
        counter = None if staged is None else stack.enter_context(instrument(sync=lambda: sync(device)))
        if auction:
            stack.enter_context(mock.patch.object(SV, "SPARSE_N", 1 << 62))
        p = stack.enter_context(Probe(device, every, beat))
        rec["sparse_n"], rec["auction_min"] = SV.SPARSE_N, SV.AUCTION_MIN
        sync(device)
        t = time.perf_counter()
        res = run_merge(cfg, streaming=True, progress=False)
        sync(device)
        rec["wall_s"] = time.perf_counter() - t
    job = res.job
    al = job.alignments[1] if align != "none" else None
    tensors = [x for e in (al.elements.values() if al else ())
               for x in (e, *(getattr(e, k, None) for k in ("index", "co", "contra"))) if isinstance(x, torch.Tensor)]
    rec.update(solver_calls=p.summary(), mode=res.mode, timings=dict(job.timings),
               ledger_peak_gb=job.resources.ledger.peak / GB,
               align_seconds={k: v for k, v in (al.seconds if al else {}).items() if isinstance(v, (int, float))},
               peak_gpu_allocated_gb=torch.cuda.max_memory_allocated(device) / GB if cuda else None,
               peak_gpu_reserved_gb=torch.cuda.max_memory_reserved(device) / GB if cuda else None,
               peak_rss_gb=p.rss_peak / GB, rss_peak_from="VmHWM" if p.hwm_reset else "sampled 0.2 s",
               read_gb=p.read / GB, reads=p.reads, solver_devices=p.solver_devices,
               element_devices=sorted({t.device.type for t in tensors}))
    if counter is not None:
        rec["stages"] = stage_rows(counter, staged)
    del res, job, al, tensors
    rec["out_bytes"] = sum(f.stat().st_size for f in weight_files(out))
    t = time.perf_counter()
    rec["check"] = check_output(out, pair["a"], load_check)
    rec["check"]["seconds"] = time.perf_counter() - t
    rec["samples"] = samples(out)
    return rec


def run_depth(a, layers, device, staged_pk, save) -> dict:
    """One depth: the pair written, the runs measured (``save(depth record)`` after each)."""
    work = Path(a.work)
    config = llama_config(a.shape, layers)
    sizes = model_sizes(config)
    d = {"layers": layers, "params": sizes["parameters"], "model_gb": sizes["bytes"] / GB, "runs": {}}
    save(d)
    pair = ensure_pair(work, a.shape, layers, workers=a.workers)
    d["write"] = {"seconds": pair["write"]["a"]["seconds"], "workers": a.workers, "reused": not pair["written"],
                  "gb": sum(pair["write"][m]["bytes"] for m in "ab") / GB}
    inputs = {m: samples(pair[m]) for m in "ab"}
    exact = {k: (inputs["a"][k] * 0.5 + inputs["b"][k] * 0.5).bfloat16().float() for k in inputs["a"]}
    runs = {"unaligned": {"align": "none"}, "aligned": {}}  # merge_once's arguments, by run
    runs = dict(reversed(runs.items())) if a.aligned_first else runs
    runs |= {"aligned, device auction": {"auction": True}} if layers in a.auction_layers else {}
    runs |= {"aligned, until discrete": {"until": "discrete"}} if layers in a.discrete_layers else {}
    runs |= {"aligned_staged": {"staged": staged_pk}} if staged_pk is not None else {}
    runs |= {f"aligned, budget {b}": {"budget": b} for at, b in a.budget_runs if at == layers}
    runs = {k: v for k, v in runs.items() if v.get("align") == "none" or not a.skip_aligned}
    data = token_data(pair["dir"], config.vocab_size, 16) if a.methods else None
    runs |= {f"{m}, unaligned": {"align": "none", "method": m, "data": data} for m in a.methods}
    load_check, got = sizes["bytes"] <= a.load_check_gb * GB, {}
    for name, kw in runs.items():
        kw = {"budget": a.memory_budget, **kw}
        if a.cache == "cold":
            drop_cache([str(f) for m in "ab" for f in weight_files(pair[m])])

        def beat(now, name=name):
            d["runs"][name] = {"running": now}
            save(d)
            big = "; ".join(f"{k}: {v['calls']} in {v['seconds']:.1f} s" for k, v in now["solver_calls"].items()
                            if "[n<1024]" not in k)
            gpu = f", GPU {now['gpu_now_gb']:.1f} GB now, {now['gpu_peak_gb']:.1f} GB peak" \
                if now["gpu_now_gb"] is not None else ""
            log(f"  [{layers} layers, {name}] {now['elapsed_s']:.0f} s: read {now['read_gb']:.1f} GB, RSS "
                f"{now['rss_gb']:.1f} GB{gpu}" + (f"; {big}" if big else ""))
        d["runs"][name] = {"running": {"elapsed_s": 0.0}}
        save(d)
        try:
            r = merge_once(pair, device, work / "out", load_check, every=a.heartbeat, beat=beat, **kw)
        except Exception as e:  # noqa: BLE001 - recorded (out of memory, a device error), and the next run goes on
            d["runs"][name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                               "where": traceback.format_exc().splitlines()[-4:-1], "memory_budget": kw["budget"],
                               "running": d["runs"][name].get("running", {}),
                               "peak_gpu_allocated_gb": torch.cuda.max_memory_allocated(device) / GB
                               if device.type == "cuda" else None}
            shutil.rmtree(work / "out", ignore_errors=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save(d)
            log(f"  [{layers} layers, {name}] FAILED: {d['runs'][name]['error']}")
            continue
        r["memory_budget"] = kw["budget"]
        r["read_x_pair"] = r["read_gb"] * GB / (2 * sizes["bytes"])
        got[name] = r.pop("samples")
        if r["align"] == "none" and r["method"] == "average":
            r["samples_vs_exact_average"] = _max_diff(got[name], exact)
        shutil.rmtree(work / "out", ignore_errors=True)
        d["runs"][name] = r
        for other, x in d["runs"].items():  # whichever ran first
            if x.get("align") == "weights" and "unaligned" in got and other in got:
                x["samples_vs_unaligned"] = _max_diff(got[other], got["unaligned"])
        if {"unaligned", "aligned"} <= set(got):
            d["ratio"] = d["runs"]["aligned"]["wall_s"] / d["runs"]["unaligned"]["wall_s"]
        save(d)
        log(f"  [{layers} layers, {name}] {r['wall_s']:.1f} s, peak GPU {dash(r['peak_gpu_allocated_gb'])} GB, RSS "
            f"{r['peak_rss_gb']:.2f} GB, read {r['read_gb']:.1f} GB, output {'ok' if r['check']['ok'] else 'FAILED'}")
    shutil.rmtree(pair["dir"], ignore_errors=True)
    return d


def warmup(a, device) -> float:
    """A tiny-shape aligned merge on the device (imports, the device's libraries), timed."""
    pair = ensure_pair(Path(a.work), "tiny", 1, workers=1)
    t = time.perf_counter()
    merge_once(pair, device, Path(a.work) / "out-warmup", False)
    shutil.rmtree(Path(a.work) / "out-warmup", ignore_errors=True)
    return time.perf_counter() - t


def markdown(results: dict) -> str:
    lines = ["# Out of core on an accelerator", "",
             "Written by `python -m benchmarks.bench_device_disk` (see its docstring): a random LLaMA-shaped "
             "bf16 pair written to local disk, then `symgraph merge A B --align weights --device DEV` "
             "(`run_merge`, out of core) against `--align none` on the same device in the same process.", ""]
    for label, r in results.items():
        lines += [f"## {label}: {r['shape']} on {r['device_name']}, commit {r['commit']}, {r['when']}", "",
                  f"torch {r['torch']}; host {r['cores']} cores, {dash(r.get('ram_gb'))} GB RAM; the engine's memory "
                  f"budget: {r.get('memory_budget') or 'its default (64 MiB caches per model)'}. Warm-up (tiny "
                  f"aligned merge, not counted): {dash(r.get('warmup_s'))} s. Page cache: `--cache "
                  f"{r['cache']}` (the pair was just written: with `asis` its pages are in RAM, the share "
                  "measured by mincore is in the table, with the dirty pages not yet written back as the run "
                  "started). "
                  "Outputs are written to the page cache (no fsync).", ""]
        rows = []
        for d in r["depths"]:
            w = d.get("write", {})
            wrote = "reused" if w.get("reused") else f"{dash(w.get('seconds'))} s"
            for name, x in d["runs"].items():
                if "wall_s" not in x:
                    run = x.get("running", {})
                    state = f"**failed**: {x['error']}".replace("|", "/") if "error" in x else "**unfinished**"
                    rows.append(f"| {d['layers']} | {d['params'] / 1e9:.2f} B | {wrote} | {name} "
                                f"| {state} after {dash(run.get('elapsed_s'), '.0f')} s (read "
                                f"{dash(run.get('read_gb'))} GB, GPU peak {dash(run.get('gpu_peak_gb'))} GB) "
                                "| | | | | | | | | | |")
                    continue
                tm, al, c = x["timings"], x["align_seconds"], x["check"]
                ok = ("ok" if c["ok"] else "**FAILED**") + (" + loads" if c.get("from_pretrained") else "")
                if "samples_vs_exact_average" in x:
                    ok += f"; rows vs bf16 average: {x['samples_vs_exact_average']:.2g}"
                if "samples_vs_unaligned" in x:
                    ok += f"; rows vs unaligned: {x['samples_vs_unaligned']:.2g}"
                cached = x["inputs_in_page_cache"]
                rows.append([
                    d["layers"], f"{d['params'] / 1e9:.2f} B", wrote, name, f"**{x['wall_s']:.1f} s**",
                    dash(tm.get("analyze")), dash(tm.get("align")), dash(tm.get("write")), dash(al.get("solver")),
                    al.get("sweeps", "–"),
                    f"{dash(x['peak_gpu_allocated_gb'])} / {dash(x['peak_gpu_reserved_gb'])} GB",
                    f"{x['peak_rss_gb']:.1f} GB", f"{x['read_gb']:.1f} GB ({x['read_x_pair']:.1f})",
                    f"{dash(cached and 100 * cached, '.0f')}%, {dash(x.get('meminfo_before', {}).get('dirty_gb'))} GB",
                    ok])
        lines += table(["layers", "params", "pair written", "run", "wall", "analysis", "alignment", "write", "solver",
                        "sweeps", "peak GPU alloc / reserved", "peak RSS", "read (× pair)", "inputs cached, dirty",
                        "output"], rows, ["r", "r", "r", None] + ["r"] * 10 + [None])
        lines += [""] + [f"Aligned ÷ unaligned at {d['layers']} layers: {d['ratio']:.1f}x." for d in r["depths"]
                         if "ratio" in d]
        runs = [(d["layers"], name, x) for d in r["depths"] for name, x in d["runs"].items()]
        for layers, name, x in runs:  # the large solves of each run (finished, or so far)
            calls = x.get("solver_calls") or x.get("running", {}).get("solver_calls") or {}
            big = [f"{k}: {v['calls']} calls, {v['seconds']:.1f} s" for k, v in calls.items() if "[n<1024]" not in k]
            if big:
                lines.append(f"Solver calls at n ≥ 1024, {name} at {layers} layers"
                             f"{'' if 'wall_s' in x else ' (so far)'}: " + "; ".join(big) + ".")
        for layers, name, x in (run for run in runs if "stages" in run[2]):
            lines += ["", f"Stages, {name} at {layers} layers (each synchronised; wall {x['wall_s']:.1f} s):", ""]
            lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "GB"],
                           [[st, s["calls"], f"{s['seconds']:.2f}", dash(s["gflop"] or None, ".0f"),
                             dash(s["gflops"], ".0f"), f"{dash(s['of_peak'] and 100 * s['of_peak'])}%",
                             dash(s["gb"] or None, ".2f")]
                            for st, s in sorted(x["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                           [None] + ["r"] * 6)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = device_args("bench_device_disk", __doc__, "2,32", DEFAULT_OUT, "cuda, cpu, or fakegpu (the test device)")
    ints = lambda s: {int(x) for x in s.split(",") if x}  # noqa: E731
    ap.add_argument("--work", default=DEFAULT_WORK, help="pairs and outputs (local disk)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes writing the pair")
    ap.add_argument("--cache", choices=("asis", "cold"), default="asis")
    ap.add_argument("--load-check-gb", type=float, default=2.0, help="from_pretrained outputs up to this size")
    ap.add_argument("--memory-budget", default=None, help="the engine's --memory-budget (default: its own)")
    ap.add_argument("--budget-runs", default="", type=lambda s: [(int(x.split(":")[0]), x.split(":")[1])
                                                                  for x in s.split(",") if x],
                    help="DEPTH:BUDGET,...: another aligned run at that depth with that --memory-budget")
    ap.add_argument("--methods", default="", type=lambda s: [m for m in s.split(",") if m],
                    help="comma-separated methods that read data (regmean, fisher), each also run unaligned")
    ap.add_argument("--auction-layers", default="", type=ints, help="depths also aligned with the auction forced")
    ap.add_argument("--discrete-layers", default="", type=ints, help="depths also aligned with --until discrete")
    ap.add_argument("--skip-aligned", action="store_true", help="only the unaligned merge and the --methods runs")
    ap.add_argument("--heartbeat", type=float, default=15.0, help="seconds between progress lines (0: none)")
    ap.add_argument("--solver-threads", type=int, default=None, help="symgraph.solve.turns.THREADS")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--aligned-first", action="store_true", help="the aligned merge before the unaligned one")
    a = ap.parse_args(argv)
    if a.solver_threads is not None:
        from symgraph.solve import turns
        turns.THREADS = max(1, a.solver_threads)
    if a.device.startswith("fakegpu"):
        from symgraph.testing.device import install
        install()
    device = device_of(a, "bench_device_disk")
    if device is None:
        return 2
    Path(a.work).mkdir(parents=True, exist_ok=True)
    threads = f"-solver-threads-{a.solver_threads}" if a.solver_threads is not None else ""
    label = a.label or f"{a.shape}-{device.type}-disk{threads}-{a.commit}"
    r = {**header(a.shape, device, a.commit), "cache": a.cache, "memory_budget": a.memory_budget,
         "ram_gb": machine_info()["ram_gb"], "depths": []}
    lock = threading.Lock()

    def save(d=None):
        with lock:
            if d is not None and all(x is not d for x in r["depths"]):
                r["depths"].append(d)
            write_entry(a.out, label, r, markdown)  # whole files: a timeout may stop us any time
    matmul_rates()  # the record's yardstick, measured once before anything is timed
    r["warmup_s"] = None if a.no_warmup else warmup(a, device)
    # the stage rows' "of peak": 8192³ and 2048² on CUDA; small elsewhere (only the code path is exercised)
    sizes = (8192, 2048) if device.type == "cuda" else (256, 64)
    r["peaks"] = peaks(device, *sizes) if set(a.stages) & set(a.layers) else None
    save()
    for layers in a.layers:
        run_depth(a, layers, device, r["peaks"] if layers in a.stages else None, save)
        log(markdown({label: r}))
    return 0


if __name__ == "__main__":
    script(main)

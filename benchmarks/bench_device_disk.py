"""Out of core on an accelerator: ``symgraph merge A B --align weights --device DEV`` on a
LLaMA-shaped bf16 pair read from disk, against the unaligned merge (``--align none``) of the
same pair on the same device in the same process, by depth.

For each depth a pair of random bf16 checkpoints is written under ``--work`` by
:mod:`benchmarks.bench_scale`'s writer (sharded as ``save_pretrained`` shards them, the
model on the meta device, each tensor seeded by its name), its shards by ``--workers``
processes at once; its time is recorded and not counted. Then, each as the command runs it
(:func:`symgraph.app.run.run_merge` with ``streaming=True``: headers, analysis of the
meta model, alignment from tensors read on demand, the merge written shard by shard and
renamed into place, its record and card), in this process: the unaligned merge, the aligned
merge, and at the depths of ``--stages`` the aligned merge again with
:mod:`benchmarks.bench_cost`'s stage counters (each stage synchronised with the device).
Unaligned first: a run the outer ``timeout`` stops still leaves the baseline. A warm-up merge
of the ``tiny`` shape on the device runs first (imports, the device's context and libraries:
not counted; its time is recorded).

Per run: wall seconds end to end (no process start, no imports); the engine's timings
(analysis, alignment, write), the alignment's own (solver seconds, sweeps) and its ledger's
peak; the device's peak memory (``max_memory_allocated`` / ``max_memory_reserved``, reset
before each run); the process's peak resident set (``VmHWM`` reset through
``/proc/self/clear_refs``, else sampled every 0.2 s: safetensors' mapped pages count); the
bytes read from the checkpoints (``Checkpoint.read``) and how many times the pair that is;
the devices of the similarities the solvers were given; the inputs' share in the page cache
just before (``mincore``: the pair was just written, so with ``--cache asis`` the reads come
from RAM; ``cold`` drops them first); whether the output has the input's tensors, shapes and
dtype (headers) and, up to ``--load-check-gb`` per model, loads with ``from_pretrained``;
a few rows of four tensors against the inputs (the unaligned merge against bf16(A/2 + B/2),
the aligned one against the unaligned). Each output is deleted once measured, each pair once
its depth is done (``--keep`` keeps them). JSON and Markdown are rewritten after every run,
and every ``--heartbeat`` seconds during one (elapsed, bytes read, memory so far, and the
assignment and Procrustes calls so far: count and seconds by status and size, so that a run
the timeout stops still says what its solves cost).

Measurement switches (the library's defaults are not changed): ``--auction-layers DEPTHS``
adds at those depths the run "aligned, device auction", the aligned merge with
``symgraph.solve._solvers.SPARSE_N`` raised past any size for that run only, so that square
assignments from ``AUCTION_MIN`` on go to the device auction instead of the host's sparse
LAPJVsp on top-k candidates (on a device; on the CPU they go to SciPy's dense solve);
``--skip-aligned`` runs only the unaligned merge and the ``--methods`` runs (RegMean's cost
beside the plain average's).
"""
from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from benchmarks.bench_device import device_args, device_plan, header, peaks
from benchmarks.harness import script, sync
from benchmarks.provenance import log, matmul_rates, table, write_entry
from benchmarks.solver_tally import SolverTally, forced_auction
from benchmarks.scale.checkpoints import ensure_pair, llama_config, model_sizes, weight_files
from benchmarks.scale.probe import Probe, meminfo, resident
from benchmarks.scale.stages import token_data

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "device" / "disk.json"
DEFAULT_WORK = "/tmp/symgraph-device-disk"
UNTIL_DISCRETE = "aligned, until discrete"  # the run of --discrete-layers
GB = 1e9
SAMPLES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.mlp.gate_proj.weight", "lm_head.weight")
ROWS = 8  # rows of each sample tensor compared
def samples(path) -> dict:
    """The first :data:`ROWS` rows of each of :data:`SAMPLES` (float32)."""
    from benchmarks.scale.checkpoints import tensor_files
    from safetensors import safe_open
    files, out = tensor_files(path), {}
    for k in SAMPLES:
        if k in files:
            with safe_open(str(files[k]), framework="pt") as h:
                out[k] = h.get_slice(k)[:ROWS].float()
    return out


def _max_diff(x: dict, y: dict) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def disk_peaks(device) -> dict:
    """Matmul and SVD rates on ``device`` for the stage rows' "of peak" (8192³ and 2048² on
    CUDA; small elsewhere: only the code path is exercised there)."""
    n, m = (8192, 2048) if device.type == "cuda" else (256, 64)
    return peaks(device, n, m, heads=False)


def merge_once(pair, align, device, out, load_check, probe_args, staged=None, budget=None, method="average",
               data=None, auction=False, until="gap") -> dict:
    """One ``run_merge`` of the pair into ``out`` (``method``, reading ``data`` if it needs
    data; ``auction``: with the device auction forced, see the module docstring; ``until``:
    when weight matching's sweeps end), measured."""
    from symgraph.app.config import MergeConfig
    from symgraph.app.run import run_merge
    from benchmarks.scale.checks import check_output
    shutil.rmtree(out, ignore_errors=True)
    inputs = [str(f) for m in (pair["a"], pair["b"]) for f in weight_files(m)]
    rec = {"align": align, "method": method, "until": until, "inputs_in_page_cache": resident(inputs), "meminfo_before": meminfo()}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        rec["gpu_before_gb"] = torch.cuda.memory_allocated(device) / GB
    cfg = MergeConfig(models=[pair["a"], pair["b"]], out=str(out), align=align, device=str(device),
                      memory_budget=budget, method=method, data=data, until=until)
    counter = None
    if staged is not None:
        from benchmarks.bench_cost import instrument
        counter = instrument(sync=lambda: sync(device))
    try:
        with forced_auction(auction), SolverTally() as tally, Probe(probe_args[0], device, *probe_args[1:]) as p:
            from symgraph.solve import _solvers as SV
            rec["sparse_n"], rec["auction_min"] = SV.SPARSE_N, SV.AUCTION_MIN
            sync(device)
            t = time.perf_counter()
            res = run_merge(cfg, streaming=True, progress=False)
            sync(device)
            rec["wall_s"] = time.perf_counter() - t
        rec["solver_calls"] = tally.summary()
    finally:
        if counter is not None:
            counter.undo()
    job = res.job
    al = job.alignments[1] if align != "none" else None
    cuda = device.type == "cuda"
    rec.update(mode=res.mode, timings=dict(job.timings), ledger_peak_gb=job.resources.ledger.peak / GB,
               align_seconds={k: v for k, v in (al.seconds if al else {}).items() if isinstance(v, (int, float))},
               peak_gpu_allocated_gb=torch.cuda.max_memory_allocated(device) / GB if cuda else None,
               peak_gpu_reserved_gb=torch.cuda.max_memory_reserved(device) / GB if cuda else None,
               peak_rss_gb=p.rss_peak / GB, rss_peak_from="VmHWM" if p.hwm_reset else "sampled 0.2 s",
               read_gb=p.read / GB, reads=p.reads, solver_devices=p.solver_devices,
               element_devices=sorted({t.device.type for e in (al.elements.values() if al else ())
                                       for t in _tensors(e)}))
    if counter is not None:
        from benchmarks.bench_cost import stage_rows
        rec["stages"] = stage_rows(counter, staged)
    del res, job, al
    rec["out_bytes"] = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    t = time.perf_counter()
    rec["check"] = check_output(out, pair["a"], load_check)
    rec["check"]["seconds"] = time.perf_counter() - t
    rec["samples"] = samples(out)
    return rec


def _tensors(e):
    for attr in ("index", "co", "contra"):
        if isinstance(getattr(e, attr, None), torch.Tensor):
            yield getattr(e, attr)
    if isinstance(e, torch.Tensor):
        yield e


def run_depth(a, layers, device, staged_pk, save) -> dict:
    """One depth: the pair written, the runs measured (``save(depth record)`` after each)."""
    work = Path(a.work)
    config = llama_config(a.shape, layers)
    sizes = model_sizes(config)
    d = {"layers": layers, "params": sizes["parameters"], "model_gb": sizes["bytes"] / GB, "runs": {}}
    save(d)
    pair = ensure_pair(work, a.shape, layers, workers=a.workers)
    if a.sync:  # the pair's dirty pages written back before any run (not counted)
        t = time.perf_counter()
        os.sync()
        d["sync_s"] = time.perf_counter() - t
    d["write"] = {"seconds": pair["write"]["a"]["seconds"], "workers": a.workers, "reused": not pair["written"],
                  "gb": sum(pair["write"][m]["bytes"] for m in "ab") / GB}
    inputs = {m: samples(pair[m]) for m in "ab"}
    exact = {k: (inputs["a"][k] * 0.5 + inputs["b"][k] * 0.5).bfloat16().float() for k in inputs["a"]}
    runs = [("unaligned", "none", None, a.memory_budget), ("aligned", "weights", None, a.memory_budget)]
    runs = runs[::-1] if a.aligned_first else runs
    runs = [(*r, False) for r in runs]
    runs += [("aligned, device auction", "weights", None, a.memory_budget, True)] if layers in a.auction_layers else []
    runs += [(UNTIL_DISCRETE, "weights", None, a.memory_budget, False)] if layers in a.discrete_layers else []
    runs += [("aligned_staged", "weights", staged_pk, a.memory_budget, False)] if staged_pk is not None else []
    runs += [(f"aligned, budget {b}", "weights", None, b, False) for at, b in a.budget_runs if at == layers]
    if a.skip_aligned:
        runs = [r for r in runs if r[1] == "none"]
    runs = [(*r, "average") for r in runs] + [(f"{m}, unaligned", "none", None, a.memory_budget, False, m)
                                              for m in a.methods]
    data = token_data(pair["dir"], config.vocab_size, a.data_rows) if a.methods else None
    load_check, got = sizes["bytes"] <= a.load_check_gb * GB, {}
    for name, align, pk, budget, auction, method in runs:
        if a.cache == "cold":
            from benchmarks.scale.checkpoints import drop_cache
            drop_cache([str(f) for m in "ab" for f in weight_files(pair[m])])

        def beat(now, name=name):
            tally = SolverTally.current
            now = {**now, "solver_calls": tally.summary() if tally is not None else {}}
            d["runs"][name] = {"running": now}
            save(d)
            big = "; ".join(f"{k}: {v['calls']} in {v['seconds']:.1f} s" for k, v in now["solver_calls"].items()
                            if "[n<1024]" not in k)
            log(f"  [{layers} layers, {name}] {now['elapsed_s']:.0f} s: read {now['read_gb']:.1f} GB, RSS "
                f"{now['rss_gb']:.1f} GB" + (f", GPU {now['gpu_now_gb']:.1f} GB now, {now['gpu_peak_gb']:.1f} GB "
                                             "peak" if now["gpu_now_gb"] is not None else "")
                + (f"; {big}" if big else ""))
        d["runs"][name] = {"running": {"elapsed_s": 0.0}}
        save(d)
        try:
            r = merge_once(pair, align, device, work / "out", load_check, (name, a.heartbeat, beat), pk, budget,
                           method, data if method != "average" else None, auction,
                           "discrete" if name == UNTIL_DISCRETE else "gap")
        except Exception as e:  # noqa: BLE001 - recorded (out of memory, a device error), and the next run goes on
            import traceback
            d["runs"][name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                               "where": traceback.format_exc().splitlines()[-4:-1], "memory_budget": budget,
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
        r["memory_budget"] = budget
        r["read_x_pair"] = r["read_gb"] * GB / (2 * sizes["bytes"])
        got[name] = r.pop("samples")
        if align == "none" and method == "average":
            r["samples_vs_exact_average"] = _max_diff(got[name], exact)
        shutil.rmtree(work / "out", ignore_errors=True)
        d["runs"][name] = r
        for other, x in d["runs"].items():  # whichever ran first
            if x.get("align") == "weights" and "unaligned" in got and other in got:
                x["samples_vs_unaligned"] = _max_diff(got[other], got["unaligned"])
        if {"unaligned", "aligned"} <= set(got):
            d["ratio"] = d["runs"]["aligned"]["wall_s"] / d["runs"]["unaligned"]["wall_s"]
        save(d)
        log(f"  [{layers} layers, {name}] {r['wall_s']:.1f} s, peak GPU {_f(r['peak_gpu_allocated_gb'])} GB, RSS "
            f"{r['peak_rss_gb']:.2f} GB, read {r['read_gb']:.1f} GB, output {'ok' if r['check']['ok'] else 'FAILED'}")
    if not a.keep:
        shutil.rmtree(pair["dir"], ignore_errors=True)
    return d


def warmup(a, device) -> float:
    """A tiny-shape aligned merge on the device (imports, the device's libraries), timed."""
    pair = ensure_pair(Path(a.work), "tiny", 1, workers=1)
    t = time.perf_counter()
    merge_once(pair, "weights", device, Path(a.work) / "out-warmup", False, ("warmup", 0, None))
    shutil.rmtree(Path(a.work) / "out-warmup", ignore_errors=True)
    return time.perf_counter() - t


def _f(x, fmt=".1f"):
    return "–" if x is None else format(x, fmt)


def markdown(results: dict) -> str:
    lines = ["# Out of core on an accelerator", "",
             "Written by `python -m benchmarks.bench_device_disk` (see its docstring): a random LLaMA-shaped "
             "bf16 pair written to local disk, then `symgraph merge A B --align weights --device DEV` "
             "(`run_merge`, out of core) against `--align none` on the same device in the same process.", ""]
    for label, r in results.items():
        lines += [f"## {label}: {r['shape']} on {r['device_name']}, commit {r['commit']}, {r['when']}", "",
                  f"torch {r['torch']}; host {r['cores']} cores, {_f(r.get('ram_gb'))} GB RAM; the engine's memory "
                  f"budget: {r.get('memory_budget') or 'its default (64 MiB caches per model)'}. Warm-up (tiny "
                  f"aligned merge, not counted): {_f(r.get('warmup_s'), '.1f')} s. Page cache: `--cache "
                  f"{r['cache']}` (the pair was just written: with `asis` its pages are in RAM, the share "
                  "measured by mincore is in the table, with the dirty pages not yet written back as the run "
                  f"started{'; the pair was synced first' if any('sync_s' in d for d in r['depths']) else ''}). "
                  "Outputs are written to the page cache (no fsync).", ""]
        rows = []
        for d in r["depths"]:
            w = d.get("write", {})
            wrote = "reused" if w.get("reused") else f"{_f(w.get('seconds'))} s"
            for name, x in d["runs"].items():
                if "wall_s" not in x:
                    run = x.get("running", {})
                    state = f"**failed**: {x['error']}".replace("|", "/") if "error" in x else "**unfinished**"
                    rows.append(f"| {d['layers']} | {d['params'] / 1e9:.2f} B | {wrote} | {name} "
                                f"| {state} after {_f(run.get('elapsed_s'), '.0f')} s (read "
                                f"{_f(run.get('read_gb'))} GB, GPU peak {_f(run.get('gpu_peak_gb'))} GB) "
                                "| | | | | | | | | | |")
                    continue
                tm, al, c = x["timings"], x["align_seconds"], x["check"]
                ok = ("ok" if c["ok"] else "**FAILED**") + (" + loads" if c.get("from_pretrained") else "")
                if "samples_vs_exact_average" in x:
                    ok += f"; rows vs bf16 average: {x['samples_vs_exact_average']:.2g}"
                if "samples_vs_unaligned" in x:
                    ok += f"; rows vs unaligned: {x['samples_vs_unaligned']:.2g}"
                rows.append([
                    d["layers"], f"{d['params'] / 1e9:.2f} B", wrote, name, f"**{x['wall_s']:.1f} s**",
                    _f(tm.get("analyze")), _f(tm.get("align")), _f(tm.get("write")), _f(al.get("solver")),
                    al.get("sweeps", "–"), f"{_f(x['peak_gpu_allocated_gb'])} / {_f(x['peak_gpu_reserved_gb'])} GB",
                    f"{x['peak_rss_gb']:.1f} GB", f"{x['read_gb']:.1f} GB ({x['read_x_pair']:.1f})",
                    f"{_f(x['inputs_in_page_cache'] and 100 * x['inputs_in_page_cache'], '.0f')}%, "
                    f"{_f(x.get('meminfo_before', {}).get('dirty_gb'))} GB", ok])
        lines += table(["layers", "params", "pair written", "run", "wall", "analysis", "alignment", "write", "solver",
                        "sweeps", "peak GPU alloc / reserved", "peak RSS", "read (× pair)", "inputs cached, dirty",
                        "output"], rows, ["r", "r", "r", None] + ["r"] * 10 + [None])
        lines += [""] + [f"Aligned ÷ unaligned at {d['layers']} layers: {d['ratio']:.1f}x." for d in r["depths"]
                         if "ratio" in d]
        for d in r["depths"]:  # the large solves of each run (finished, or so far)
            for name, x in d["runs"].items():
                calls = x.get("solver_calls") or x.get("running", {}).get("solver_calls") or {}
                big = [f"{k}: {v['calls']} calls, {v['seconds']:.1f} s" for k, v in calls.items() if "[n<1024]" not in k]
                if big:
                    state = "" if "wall_s" in x else " (so far)"
                    lines.append(f"Solver calls at n ≥ 1024, {name} at {d['layers']} layers{state}: " + "; ".join(big) + ".")
        for d in r["depths"]:
            for name, x in d["runs"].items():
                if "stages" in x:
                    lines += ["", f"Stages, {name} at {d['layers']} layers (each synchronised; wall "
                              f"{x['wall_s']:.1f} s):", ""]
                    lines += table(["stage", "calls", "s", "GFLOP", "GFLOP/s", "of peak", "GB"],
                                   [[st, s["calls"], f"{s['seconds']:.2f}", _f(s["gflop"] or None, ".0f"),
                                     _f(s["gflops"], ".0f"), f"{_f(s['of_peak'] and 100 * s['of_peak'], '.1f')}%",
                                     _f(s["gb"] or None, ".2f")]
                                    for st, s in sorted(x["stages"].items(), key=lambda kv: -kv[1]["seconds"])],
                                   [None] + ["r"] * 6)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = device_args("bench_device_disk", __doc__, "2,32", DEFAULT_OUT,
                     devices="cuda, cpu, or fakegpu (the test device)")
    ap.add_argument("--work", default=DEFAULT_WORK, help="pairs and outputs (local disk)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes writing the pair")
    ap.add_argument("--cache", choices=("asis", "cold"), default="asis")
    ap.add_argument("--load-check-gb", type=float, default=2.0, help="from_pretrained outputs up to this size")
    ap.add_argument("--memory-budget", default=None, help="the engine's --memory-budget (default: its own)")
    ap.add_argument("--budget-runs", default="", help="DEPTH:BUDGET,...: another aligned run at that "
                    "depth with that --memory-budget (e.g. 2:12GB, a cache of the whole 2-layer pair)")
    ap.add_argument("--methods", default="", help="comma-separated methods that read data (regmean, fisher), "
                    "each also run unaligned at every depth on random token ids")
    ap.add_argument("--data-rows", type=int, default=16, help="sequences of 128 tokens in their data")
    ap.add_argument("--auction-layers", default="", help="depths (of --layers) also aligned with the device "
                    "auction forced for large squares (SPARSE_N raised for that run: a measurement switch)")
    ap.add_argument("--discrete-layers", default="", help="depths (of --layers) also aligned with --until "
                    "discrete (the sweeps end once no discrete element changes)")
    ap.add_argument("--skip-aligned", action="store_true", help="only the unaligned merge and the --methods runs")
    ap.add_argument("--heartbeat", type=float, default=15.0, help="seconds between progress lines (0: none)")
    ap.add_argument("--solver-threads", type=int, default=None, help="symgraph.solve.turns.THREADS: host "
                    "solves of a sweep's independent units at once (1: one after the other; default: the library's)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--sync", action="store_true", help="write the pair back to disk before the runs (os.sync)")
    ap.add_argument("--aligned-first", action="store_true", help="the aligned merge before the unaligned one")
    ap.add_argument("--keep", action="store_true", help="keep the pairs")
    a = ap.parse_args(argv)
    a.budget_runs = [(int(x.split(":")[0]), x.split(":")[1]) for x in a.budget_runs.split(",") if x]
    a.methods = [m for m in a.methods.split(",") if m]
    a.auction_layers = {int(x) for x in a.auction_layers.split(",") if x}
    a.discrete_layers = {int(x) for x in a.discrete_layers.split(",") if x}
    if a.solver_threads is not None:
        from symgraph.solve import turns
        turns.THREADS = max(1, a.solver_threads)
    if a.device.startswith("fakegpu"):
        from symgraph.testing.device import install
        install()
    plan = device_plan(a, "bench_device_disk")
    if plan is None:
        return 2
    from benchmarks.harness import machine_info
    device, depths, staged, out = plan
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
            write_entry(out, label, r, markdown)  # whole files: a timeout may stop us any time
    matmul_rates()  # the record's yardstick, measured once before anything is timed
    r["warmup_s"] = None if a.no_warmup else warmup(a, device)
    r["peaks"] = disk_peaks(device) if staged & set(depths) else None
    save()
    for layers in depths:
        run_depth(a, layers, device, r["peaks"] if layers in staged else None, save)
        log(markdown({label: r}))
    return 0


if __name__ == "__main__":
    script(main)

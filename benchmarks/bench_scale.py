"""Scale benchmark: ``symgraph merge`` on LLaMA-shaped bf16 checkpoints against mergekit's
linear merge of the same pair, in the same run.

A pair of random bf16 checkpoints of each of ``--shapes`` (``--layers`` overrides the depth) is
written once under ``--work`` as ``save_pretrained(max_shard_size="1GB")`` lays it out, one tensor
at a time from a meta-device model (``normal * 0.02``, norm weights ones, each tensor seeded by its
model's seed and its name), by a child process whose wall time and peak RSS go with the pair.

Each stage runs in a subprocess under a wrapper that starts exactly one child and reports its
own ``getrusage(RUSAGE_CHILDREN)``: the child's peak resident set (mapped file pages count) and CPU
time; wall time is taken around start and wait. A stage past ``--timeout`` is killed with its
process group; a failed one (OOM killer: rc -9) is recorded with its last stderr line.
``read_cold`` / ``read_warm`` read and clone every tensor of model A (GB/s over the loop) after
dropping its files from the page cache, and from the cache; ``mergekit_linear`` is mergekit 0.1.5
(its own venv) at 0.5/0.5 in bfloat16 on CPU with its lowest-memory settings; the symgraph stages
are :data:`MERGE_STAGES` (``--data``: 32 random rows of 128 token ids; ``--memory-budget`` and
``--max-iter`` to each); ``symgraph_weights_baseline`` runs ``symgraph_weights``' command in this repository's tree
at ``--baseline``. Before each merge, earlier outputs are written back (``os.sync``) and the
inputs read through (``--cache warm``) or dropped. The machine's float32 and bfloat16 matmul rates
are measured before and after the stages (a fresh process, 4096², best of 3). GB is 10^9 bytes.

Checks: every output holds the input's tensor names and shapes, all bf16 (headers), and up to
``--load-check-gb`` per model loads with ``from_pretrained``; ``symgraph_none`` against mergekit's
output and both against the exact ``bf16(0.5 A + 0.5 B)``: max abs difference, elements that
differ, all within one bf16 ulp. Results: ``--out`` (JSON; ``--append`` keeps other shapes) and
a Markdown table beside it. Merge outputs are deleted after the checks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .bench_cost import dash
from .harness import machine_info, script
from .provenance import REPO_ROOT, git_state, table, write_beside
# make_tensor: re-exported for benchmarks/tests/test_bench_scale.py
from .scale.checkpoints import (check_output, compare_outputs, dir_bytes, drop_cache, ensure_pair,  # noqa: F401
                                llama_config, make_tensor, model_sizes, read_all, token_data, warm_cache, weight_files,
                                write_checkpoint)
from .scale.common import (BASELINE, DEFAULT_OUT, DEFAULT_WORK, ENTRY, GB, MERGEKIT_SHARD_PARAMS, SHAPES, STAGES,
                           child_env, ensure_mergekit, log, matmul_rates, measure, mergekit_config, mergekit_version)

DEFAULT_STAGES = tuple(s for s in STAGES if s != BASELINE)  # the baseline runs when asked for
#: The symgraph stages: ``symgraph merge A B --align ALIGN --method METHOD FLAGS`` (``repair``:
#: ``--repair`` after a plain average). The sweeps of ``_exact`` end once no element changes,
#: ``_discrete`` once no discrete element does, ``_tol`` once no class gains 0.1%.
MERGE_STAGES = {"symgraph_none": ("none", "average", []), "symgraph_weights": ("weights", "average", []),
                "symgraph_weights_exact": ("weights", "average", ["--until", "exact"]),
                "symgraph_weights_discrete": ("weights", "average", ["--until", "discrete"]),
                "symgraph_weights_tol": ("weights", "average", ["--tol", "1e-3"]),
                "symgraph_activations": ("activations", "average", []),
                "symgraph_regmean": ("weights", "regmean", []), "symgraph_fisher": ("weights", "fisher", []),
                "symgraph_repair": ("weights", "repair", []), BASELINE: ("weights", "average", [])}


def needs_data(name: str) -> bool:
    align, method, _ = MERGE_STAGES[name]
    return align == "activations" or method != "average"


def merge_command(name: str, a, b, out, data=None, memory_budget: str | None = None,
                  max_iter: int | None = None) -> list:
    """The ``symgraph merge`` command line of the symgraph stage ``name``: ``data`` the token file
    of the stages that read data (refused where none does), ``memory_budget`` the engine's
    ``--memory-budget``, ``max_iter`` weight matching's ``--max-iter`` (None: their defaults)."""
    align, method, flags = MERGE_STAGES[name]
    if (data is not None) != needs_data(name):
        raise ValueError(f"stage {name}: data {'missing' if data is None else 'given but not read'}")
    cmd = [sys.executable, "-m", "symgraph", "merge", str(a), str(b), "--out", str(out), "--align", align,
            *(["--repair"] if method == "repair" else ["--method", method]), *flags]
    cmd += ["--data", str(data)] if data is not None else []
    cmd += ["--max-iter", str(max_iter)] if max_iter is not None and align == "weights" else []
    return cmd + (["--memory-budget", memory_budget] if memory_budget is not None else [])


def baseline_tree(work: Path, ref: str) -> dict:
    """This repository's tree at ``ref`` (``git archive``, once, under ``work``): the baseline
    stage runs there, so its code is that commit's and its environment this run's."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = Path(work) / f"baseline-{sha[:12]}"
    if not (tree / "symgraph" / "__main__.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=REPO_ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return {"commit": sha, "dir": str(tree)}


def run_shape(shape: str, a, baseline: dict | None) -> dict:
    """One shape's record: the pair, each of ``a.stages`` measured, the ratios and the checks."""
    config = llama_config(shape, a.layers)
    n_layers = config.num_hidden_layers
    full, sizes = model_sizes(llama_config(shape)), model_sizes(config)
    log(f"[{shape}, {n_layers} layers] {sizes['parameters'] / 1e9:.3f} B parameters, "
        f"{sizes['bytes'] / GB:.2f} GB per model")
    pair = ensure_pair(Path(a.work), shape, a.layers)
    here, inputs = Path(pair["dir"]), [str(f) for m in "ab" for f in weight_files(pair[m])]
    rec = {"shape": shape, "layers": n_layers, "full_layers": SHAPES[shape]["num_hidden_layers"],
           "config": SHAPES[shape] | {"num_hidden_layers": n_layers}, "dtype": "bfloat16",
           **sizes, "full_model_parameters": full["parameters"], "full_model_bytes": full["bytes"],
           "bytes_on_disk_per_model": dir_bytes(pair["a"]), "pair": pair, "cache": a.cache, "stages": {},
           "run": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "symgraph_commit": git_state(),
                   "timeout_s": a.timeout, "memory_budget": a.memory_budget, "max_iter": a.max_iter,
                   "baseline_commit": baseline and baseline["commit"]},
           "matmul_gflops": {"before": matmul_rates(child_env())}}
    outdir, logdir, st = here / "out", here / "logs", rec["stages"]
    outdir.mkdir(exist_ok=True)
    logdir.mkdir(exist_ok=True)

    def stage(name, cmd, files=inputs, mode=a.cache, out=None, env=None, cwd=REPO_ROOT) -> dict:
        """``cmd`` measured as stage ``name`` once ``files`` (its inputs) are dropped from the page
        cache or read through (``mode``) and, before a merge into ``out``, earlier outputs are
        written back (no stage pays for another's writes: this disk writes back at ~40 MB/s)."""
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
        (drop_cache if mode == "cold" else warm_cache)(files)
        r = measure(cmd, timeout=a.timeout, env=env or child_env(), cwd=cwd, log_prefix=str(logdir / name))
        r.update(cmd=[str(c) for c in cmd], bytes_in=sum(os.path.getsize(f) for f in files))
        if out is not None and r["rc"] == 0 and Path(out).exists():
            r.update(bytes_out=dir_bytes(out), out=str(out))
            meta = Path(out) / "symgraph_merge.json"  # symgraph's own record: its alignment's sweeps
            if meta.exists():
                als = [x for x in json.loads(meta.read_text()).get("alignments", []) if x]
                r["sweeps"] = [x.get("seconds", {}).get("sweeps") for x in als] or None
        r.update(peak_rss_gb=r["peak_rss_bytes"] / GB, cpu_s=r["user_s"] + r["sys_s"],
                 in_gb_per_s=r["bytes_in"] / GB / r["wall_s"] if r["wall_s"] else None,
                 seconds_per_layer=r["wall_s"] / n_layers, ok=r["rc"] == 0 and not r["timed_out"])
        st[name] = r
        status = "ok" if r["ok"] else f"FAILED rc={r['rc']}: {r.get('error')}"
        log(f"  {name:<17} {r['wall_s']:8.1f} s  peak RSS {r['peak_rss_gb']:6.2f} GB  {status}")
        return r

    for name in ("read_cold", "read_warm"):  # read throughput, model A only
        if name in a.stages:
            r = stage(name, [sys.executable, "-m", ENTRY, "--_read", pair["a"]],
                      [str(f) for f in weight_files(pair["a"])], name[5:])
            if r["ok"]:
                r["read"] = json.loads(Path(r["stdout_log"]).read_text().strip().splitlines()[-1])
    mk_out, venv = outdir / "mergekit_linear", Path(a.work) / "mergekit-venv"
    if "mergekit_linear" in a.stages:
        exe, msg = ensure_mergekit(venv)
        rec["mergekit"] = {"venv": str(venv), "message": msg}
        if exe is None:
            log(f"  mergekit_linear    skipped: {msg}")
            st["mergekit_linear"] = {"skipped": msg, "ok": False}
        else:
            rec["mergekit"]["versions"] = mergekit_version(venv)
            (here / "mergekit.yml").write_text(mergekit_config(pair["a"], pair["b"]))
            stage("mergekit_linear", [exe, here / "mergekit.yml", mk_out, "--lazy-unpickle", "--no-async-write",
                                      "--no-copy-tokenizer", "--no-cuda", "--out-shard-size", MERGEKIT_SHARD_PARAMS,
                                      "--quiet"], out=mk_out, env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=here)
    for name in (s for s in MERGE_STAGES if s in a.stages):
        data = token_data(here, config.vocab_size) if needs_data(name) else None
        cmd = merge_command(name, pair["a"], pair["b"], outdir / name, data, a.memory_budget, a.max_iter)
        if name == BASELINE:  # python -m symgraph finds its tree first
            stage(name, cmd, out=outdir / name, env=child_env(PYTHONPATH=baseline["dir"]), cwd=baseline["dir"])
        else:
            stage(name, cmd, out=outdir / name)

    mk = st.get("mergekit_linear", {})
    for name, r in st.items():
        if name.startswith("symgraph") and mk.get("ok") and r.get("ok"):
            r["time_ratio_vs_mergekit"] = r["wall_s"] / mk["wall_s"]
            r["rss_ratio_vs_mergekit"] = r["peak_rss_bytes"] / mk["peak_rss_bytes"]
    if st.get(BASELINE, {}).get("ok") and st.get("symgraph_weights", {}).get("ok"):
        st["symgraph_weights"]["time_ratio_vs_baseline"] = st["symgraph_weights"]["wall_s"] / st[BASELINE]["wall_s"]
    load_check = sizes["bytes"] <= a.load_check_gb * GB
    t = time.perf_counter()
    checks = {"from_pretrained": load_check, "inputs": {m: check_output(pair[m], pair["a"], load_check) for m in "ab"}}
    for name in ("mergekit_linear", *MERGE_STAGES):  # every output: names, shapes, bf16 (and loads)
        if st.get(name, {}).get("ok") and st[name].get("out"):
            checks[name] = check_output(st[name]["out"], pair["a"], load_check)
    if st.get("symgraph_none", {}).get("ok") and mk.get("ok"):
        checks["none_vs_mergekit"] = compare_outputs(outdir / "symgraph_none", mk_out, pair["a"], pair["b"])
    rec["matmul_gflops"]["after"] = matmul_rates(child_env())
    rec["checks"] = checks | {"seconds": time.perf_counter() - t}
    for k, v in checks.items():
        if isinstance(v, dict) and "ok" in v:
            log(f"  check {k:<17} {'ok' if v['ok'] else 'FAILED'}"
                + (f"  (max |symgraph - mergekit| {v['symgraph_vs_mergekit']['max_abs_diff']:.3g})"
                   if k == "none_vs_mergekit" and "symgraph_vs_mergekit" in v else ""))
    shutil.rmtree(outdir, ignore_errors=True)
    return rec


def run(a) -> dict:
    """Every shape of ``a`` (:func:`main`'s arguments), its record written after each."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    out = Path(a.out)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "scale", "machine": machine_info(), "shapes": []}
    if a.append and out.exists():
        now = {(s, a.layers or SHAPES[s]["num_hidden_layers"]) for s in a.shapes}
        result["shapes"] = [r for r in json.loads(out.read_text())["shapes"] if (r["shape"], r["layers"]) not in now]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tree = baseline_tree(Path(a.work), a.baseline) if a.baseline else None
    for shape in a.shapes:
        result["shapes"].append(run_shape(shape, a, tree) | {"machine": result["machine"]})
        write_beside(out, result, markdown(result))  # after every shape: a later crash keeps what was measured
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Scale benchmark: `symgraph merge` vs mergekit (linear, bf16)", "",
             f"Machine: {m['cores']} cores ({m.get('cpu')}), {dash(m['ram_gb'])} GB RAM, "
             f"device {m['device']}, torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}.", "",
             "Each stage is a separate process; peak RSS is the child's `ru_maxrss` (file-backed "
             "mmap pages included), GB = 10^9 bytes. Ratios are against `mergekit_linear` of the "
             "same run. Written by `python -m benchmarks.bench_scale` (see its docstring).", ""]
    for rec in result["shapes"]:
        s, cfg, run, c = rec["stages"], rec["config"], rec["run"], rec.get("checks", {})
        mk, w = rec.get("mergekit", {}).get("versions"), rec["pair"].get("write") or {}
        writer = (f" Pair {'written now' if rec['pair'].get('written') else 'reused'}: "
                  f"{max(v['seconds'] for v in w.values()):.1f} s per model, writer peak RSS "
                  f"{max(v['peak_rss_gb'] for v in w.values()):.2f} GB." if w and all(
                      "peak_rss_gb" in v for v in w.values()) else "")
        rates = rec.get("matmul_gflops") or {}
        b, a = rates.get("before"), rates.get("after")
        rates = (f" The machine's matmul rates (4096², best of 3, a fresh process) before / after the stages: "
                 f"float32 {b['float32']:.0f} / {a['float32']:.0f} GFLOP/s, bfloat16 {b['bfloat16']:.0f} / "
                 f"{a['bfloat16']:.0f} GFLOP/s." if b and a else "")
        lines += [f"## {rec['shape']}: {rec['layers']} of {rec['full_layers']} layers, "
                  f"{rec['parameters'] / 1e9:.3f} B parameters, {rec['bytes_on_disk_per_model'] / GB:.2f} GB "
                  "per model on disk", "",
                  f"hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / "
                  f"{cfg['num_key_value_heads']} KV, vocab {cfg['vocab_size']}; one layer "
                  f"{rec['layer_bytes'] / GB:.3f} GB, embeddings + head + norm {rec['nonlayer_bytes'] / GB:.3f} GB; "
                  f"full depth {rec['full_model_bytes'] / GB:.2f} GB per model. Page cache before merges: "
                  f"{rec['cache']}, earlier outputs written back (os.sync)."
                  + (f" symgraph's --memory-budget: {run['memory_budget']}." if run.get("memory_budget") else "")
                  + (f" Weight matching's --max-iter: {run['max_iter']}." if run.get("max_iter") else "")
                  + writer + f" Run {run['time']}, symgraph {run['symgraph_commit']}"
                  + (f", mergekit/torch/transformers {mk}" if mk else "") + "." + rates, ""]
        rows = []
        for name, r in ((n, s[n]) for n in STAGES if n in s):
            if "skipped" in r:
                rows.append(f"| {name} | | | | | | | | | skipped: {r['skipped']} |")
                continue
            status = "ok" if r["ok"] else f"**failed** rc {r['rc']}: {r.get('error') or ''}".replace("|", "/")
            if r.get("read"):
                rd = r["read"]
                status += (f": {rd['bytes'] / GB:.3g} GB in {rd['seconds']:.3g} s = {rd['gb_per_s']:.2f} GB/s "
                           "(read loop only)")
            rows.append([name, f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['peak_rss_gb']:.2f}",
                         f"{r['bytes_in'] / GB:.3g}", dash(r.get("bytes_out") and r["bytes_out"] / GB, ".3g"),
                         f"{r['seconds_per_layer']:.2f}", dash(r.get("time_ratio_vs_mergekit"), ".2f"),
                         dash(r.get("rss_ratio_vs_mergekit"), ".2f"), status])
        lines += table(["stage", "wall s", "CPU s", "peak RSS GB", "in GB", "out GB", "s / layer", "time × mergekit",
                        "RSS × mergekit", "status"], rows, [None] + ["r"] * 8 + [None])
        if s.get("symgraph_weights", {}).get("time_ratio_vs_baseline"):
            lines += ["", "symgraph_weights against the same command at the baseline commit "
                      f"`{run['baseline_commit']}` (symgraph_weights_baseline, this run): "
                      f"{s['symgraph_weights']['time_ratio_vs_baseline']:.3f}× its time."]
        sweeps = [f"{n} {', '.join(map(str, r['sweeps']))}" for n, r in s.items() if r.get("sweeps")]
        if sweeps:
            lines += ["", "Sweeps of weight matching (from each output's `symgraph_merge.json`): "
                      + "; ".join(sweeps) + "."]
        checks = [f"input {k} {'ok' if v['ok'] else 'FAILED'}" for k, v in c.get("inputs", {}).items()]
        checks += [f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in c.items() if isinstance(v, dict) and "ok" in v]
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale", description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--shapes", type=csv, default="tiny,1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--work", default=DEFAULT_WORK, help="checkpoints, outputs, logs, mergekit venv")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results; the .md goes next to it")
    ap.add_argument("--stages", type=csv, default=",".join(DEFAULT_STAGES), help="some of " + ", ".join(STAGES))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per stage")
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm", help="the inputs' page cache before a merge")
    ap.add_argument("--load-check-gb", type=float, default=0.5, help="from_pretrained outputs up to this model size")
    ap.add_argument("--append", action="store_true", help="keep other shapes' entries of an existing --out")
    ap.add_argument("--memory-budget", default=None, metavar="SIZE", help="the symgraph stages' --memory-budget")
    ap.add_argument("--max-iter", type=int, default=None, metavar="N",
                    help="weight matching's sweeps at most (the same for the baseline: a like-for-like time)")
    ap.add_argument("--baseline", metavar="REF", help="the commit of the symgraph_weights_baseline stage")
    ap.add_argument("--_read", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--_write", nargs=4, metavar=("DIR", "SHAPE", "LAYERS", "SEED"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._read:
        print(json.dumps(read_all(a._read)))
        return
    if a._write:
        path, shape, layers, seed = a._write
        print(json.dumps(write_checkpoint(path, llama_config(shape, int(layers)), int(seed))))
        return
    for s in set(a.shapes) - set(SHAPES):
        ap.error(f"unknown shape {s!r}; expected one of {', '.join(SHAPES)}")
    for s in set(a.stages) - set(STAGES):
        ap.error(f"unknown stage {s!r}; expected some of {', '.join(STAGES)}")
    if (a.baseline is None) == (BASELINE in a.stages):
        ap.error(f"--baseline REF and the stage {BASELINE} go together")
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be >= 1")
    if a.memory_budget is not None:
        from symgraph.checkpoints.sharded import parse_size
        from symgraph.errors import InputError
        try:
            parse_size(a.memory_budget)
        except InputError:
            ap.error(f"--memory-budget {a.memory_budget!r}; expected a positive size such as 256MB")
    run(a)


if __name__ == "__main__":
    script(main)

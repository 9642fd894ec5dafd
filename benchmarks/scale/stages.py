"""One shape's run: the pair, each stage in its own measured process, the ratios against
mergekit and the checks of the outputs."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from ..provenance import REPO_ROOT, git_state
from .checkpoints import dir_bytes, drop_cache, ensure_pair, llama_config, model_sizes, warm_cache, weight_files
from .checks import check_output, compare_outputs
from ..harness import machine_info  # noqa: F401 - used by run_shape's records
from .common import (BASELINE, DATA_ROWS, DATA_TOKENS, ENTRY, GB, MERGEKIT_SHARD_PARAMS, SHAPES, child_env, log,
                     matmul_rates, measure)
from .mergekit import ensure_mergekit, mergekit_config, mergekit_version

# the stages that end weight matching's sweeps by another rule than the default (until gap)
SWEEP_FLAGS = {"symgraph_weights_exact": ["--until", "exact"],  # once no element changes
               "symgraph_weights_discrete": ["--until", "discrete"],  # once no discrete element changes
               # once no class gains 0.1% (benchmarks/results/speed_quality/sweeps.md)
               "symgraph_weights_tol": ["--tol", "1e-3"]}


#: The symgraph stages: ``(--align, --method)``; ``repair``: ``--repair`` after a plain average.
MERGE_STAGES = {"symgraph_none": ("none", "average"), "symgraph_weights": ("weights", "average"),
                "symgraph_weights_exact": ("weights", "average"),  # --until exact: the former default
                "symgraph_weights_discrete": ("weights", "average"),  # --until discrete: fewer sweeps
                "symgraph_weights_tol": ("weights", "average"),  # --tol 1e-3: fewer sweeps
                "symgraph_activations": ("activations", "average"),
                "symgraph_regmean": ("weights", "regmean"), "symgraph_fisher": ("weights", "fisher"),
                "symgraph_repair": ("weights", "repair"), BASELINE: ("weights", "average")}


def _symgraph_cmd(name: str = "") -> list:
    exe = Path(sys.executable).parent / "symgraph"
    if exe.exists() and name != BASELINE:  # the baseline: python -m symgraph in its own tree
        return [str(exe)]
    return [sys.executable, "-m", "symgraph"]



def merge_command(name: str, a, b, out, data=None, memory_budget: str | None = None) -> list:
    """The ``symgraph merge`` command line of the symgraph stage ``name`` (one of
    :data:`MERGE_STAGES`): ``data`` the token file of the stages that read data (given where one
    needs it, refused where none does), ``memory_budget`` the engine's ``--memory-budget`` (None:
    its default)."""
    align, method = MERGE_STAGES[name]
    how = ["--repair"] if method == "repair" else ["--method", method]  # REPAIR after a plain average
    cmd = _symgraph_cmd(name) + ["merge", str(a), str(b), "--out", str(out), "--align", align, *how]
    cmd += SWEEP_FLAGS.get(name, [])
    if (data is not None) != needs_data(name):
        raise ValueError(f"stage {name}: data {'missing' if data is None else 'given but not read'}")
    if data is not None:
        cmd += ["--data", str(data)]
    if memory_budget is not None:
        cmd += ["--memory-budget", memory_budget]
    return cmd


def needs_data(name: str) -> bool:
    align, method = MERGE_STAGES[name]
    return align == "activations" or method != "average"


def baseline_tree(work: Path, ref: str) -> dict:
    """This repository's tree at ``ref`` (``git archive``, once, under ``work``): the baseline
    stage runs ``python -m symgraph`` there, so its code is that commit's and its environment
    this run's."""
    import subprocess
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = Path(work) / f"baseline-{sha[:12]}"
    if not (tree / "symgraph" / "__main__.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=REPO_ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return {"commit": sha, "dir": str(tree)}


def run_shape(shape: str, layers: int | None, work: Path, stages, timeout: float, cache: str,
              mergekit_venv: Path, load_check_gb: float, keep_outputs: bool,
              memory_budget: str | None = None, baseline: dict | None = None) -> dict:
    config = llama_config(shape, layers)
    n_layers = config.num_hidden_layers
    full = model_sizes(llama_config(shape))
    sizes = model_sizes(config)
    log(f"[{shape}, {n_layers} layers] {sizes['parameters'] / 1e9:.3f} B parameters, "
        f"{sizes['bytes'] / GB:.2f} GB per model")
    pair = ensure_pair(work, shape, layers)
    a, b = pair["a"], pair["b"]
    inputs = [str(f) for m in (a, b) for f in weight_files(m)]
    bytes_in = sum(os.path.getsize(f) for f in inputs)
    rec = {"shape": shape, "layers": n_layers, "full_layers": SHAPES[shape]["num_hidden_layers"],
           "config": SHAPES[shape] | {"num_hidden_layers": n_layers}, "dtype": "bfloat16",
           **sizes, "full_model_parameters": full["parameters"], "full_model_bytes": full["bytes"],
           "bytes_on_disk_per_model": dir_bytes(a), "pair": pair, "cache": cache, "stages": {},
           "run": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "symgraph_commit": git_state(),
                   "timeout_s": timeout, "memory_budget": memory_budget,
                   "baseline_commit": baseline and baseline["commit"]}}
    outdir = Path(pair["dir"]) / "out"
    outdir.mkdir(exist_ok=True)
    logdir = Path(pair["dir"]) / "logs"
    logdir.mkdir(exist_ok=True)

    rec["matmul_gflops"] = {"before": matmul_rates(child_env())}

    def prep_cache():
        os.sync()  # no stage pays for an earlier stage's writes (this disk writes back at ~40 MB/s)
        if cache == "cold":
            drop_cache(inputs)
        else:
            warm_cache(inputs)

    def finish(name, r, out=None, b_in=bytes_in):
        r["bytes_in"] = b_in
        if out is not None and r["rc"] == 0 and Path(out).exists():
            r["bytes_out"] = dir_bytes(out)
            r["out"] = str(out)
            meta = Path(out) / "symgraph_merge.json"  # symgraph's own record: its alignment's sweeps
            if meta.exists():
                als = [x for x in json.loads(meta.read_text()).get("alignments", []) if x]
                r["sweeps"] = [x.get("seconds", {}).get("sweeps") for x in als] or None
        r["peak_rss_gb"] = r["peak_rss_bytes"] / GB
        r["cpu_s"] = r["user_s"] + r["sys_s"]
        r["in_gb_per_s"] = b_in / GB / r["wall_s"] if r["wall_s"] else None
        r["seconds_per_layer"] = r["wall_s"] / n_layers
        r["ok"] = r["rc"] == 0 and not r["timed_out"]
        rec["stages"][name] = r
        status = "ok" if r["ok"] else f"FAILED rc={r['rc']}: {r.get('error')}"
        log(f"  {name:<17} {r['wall_s']:8.1f} s  peak RSS {r['peak_rss_gb']:6.2f} GB  {status}")

    # read throughput, model A only
    for name, mode in (("read_cold", "cold"), ("read_warm", "warm")):
        if name not in stages:
            continue
        files_a = [str(f) for f in weight_files(a)]
        if mode == "cold":
            drop_cache(files_a)
        else:
            warm_cache(files_a)
        r = measure([sys.executable, "-m", ENTRY, "--_read", a], timeout=timeout,
                    env=child_env(), cwd=REPO_ROOT, log_prefix=str(logdir / name))
        if r["rc"] == 0:
            try:
                r["read"] = json.loads(Path(r["stdout_log"]).read_text().strip().splitlines()[-1])
            except (ValueError, IndexError):
                pass
        finish(name, r, b_in=sum(os.path.getsize(f) for f in files_a))

    # mergekit
    mk_out = outdir / "mergekit_linear"
    if "mergekit_linear" in stages:
        exe, msg = ensure_mergekit(mergekit_venv)
        rec["mergekit"] = {"venv": str(mergekit_venv), "message": msg}
        if exe is None:
            log(f"  mergekit_linear    skipped: {msg}")
            rec["stages"]["mergekit_linear"] = {"skipped": msg, "ok": False}
        else:
            rec["mergekit"]["versions"] = mergekit_version(mergekit_venv)
            cfg = Path(pair["dir"]) / "mergekit.yml"
            cfg.write_text(mergekit_config(a, b))
            shutil.rmtree(mk_out, ignore_errors=True)
            cmd = [exe, str(cfg), str(mk_out), "--lazy-unpickle", "--no-async-write", "--no-copy-tokenizer",
                   "--no-cuda", "--out-shard-size", MERGEKIT_SHARD_PARAMS, "--quiet"]
            prep_cache()
            r = measure(cmd, timeout=timeout, env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=pair["dir"],
                        log_prefix=str(logdir / "mergekit_linear"))
            r["cmd"] = [str(c) for c in cmd]
            finish("mergekit_linear", r, mk_out)

    # symgraph
    for name in MERGE_STAGES:
        if name not in stages:
            continue
        out = outdir / name
        shutil.rmtree(out, ignore_errors=True)
        data = token_data(pair["dir"], config.vocab_size) if needs_data(name) else None
        cmd = merge_command(name, a, b, out, data, memory_budget)
        prep_cache()
        there = baseline["dir"] if name == BASELINE else REPO_ROOT  # python -m symgraph finds its tree first
        env = child_env(PYTHONPATH=baseline["dir"]) if name == BASELINE else child_env()
        r = measure(cmd, timeout=timeout, env=env, cwd=there, log_prefix=str(logdir / name))
        r["cmd"] = [str(c) for c in cmd]
        finish(name, r, out)

    # ratios against mergekit
    mk = rec["stages"].get("mergekit_linear", {})
    for name, r in rec["stages"].items():
        if name.startswith("symgraph") and mk.get("ok") and r.get("ok"):
            r["time_ratio_vs_mergekit"] = r["wall_s"] / mk["wall_s"]
            r["rss_ratio_vs_mergekit"] = r["peak_rss_bytes"] / mk["peak_rss_bytes"]
    base, now = rec["stages"].get(BASELINE, {}), rec["stages"].get("symgraph_weights", {})
    if base.get("ok") and now.get("ok"):
        now["time_ratio_vs_baseline"] = now["wall_s"] / base["wall_s"]

    # checks
    load_check = sizes["bytes"] <= load_check_gb * GB
    checks = {"from_pretrained": load_check}
    t = time.perf_counter()
    checks["inputs"] = {m: check_output(p, a, load_check) for m, p in (("a", a), ("b", b))}
    for name in ("mergekit_linear", *MERGE_STAGES):  # every output: names, shapes, bf16 (and loads)
        r = rec["stages"].get(name, {})
        if r.get("ok") and r.get("out"):
            checks[name] = check_output(r["out"], a, load_check)
    st = rec["stages"]
    if st.get("symgraph_none", {}).get("ok") and st.get("mergekit_linear", {}).get("ok"):
        checks["none_vs_mergekit"] = compare_outputs(outdir / "symgraph_none", mk_out, a, b)
    rec["matmul_gflops"]["after"] = matmul_rates(child_env())
    checks["seconds"] = time.perf_counter() - t
    rec["checks"] = checks
    for k, v in checks.items():
        if isinstance(v, dict) and "ok" in v:
            log(f"  check {k:<17} {'ok' if v['ok'] else 'FAILED'}"
                + (f"  (max |symgraph - mergekit| {v['symgraph_vs_mergekit']['max_abs_diff']:.3g})"
                   if k == "none_vs_mergekit" and "symgraph_vs_mergekit" in v else ""))
    if not keep_outputs:
        shutil.rmtree(outdir, ignore_errors=True)
    return rec


def token_data(directory, vocab: int, rows: int = DATA_ROWS) -> str:
    """``directory/data.safetensors``: ``rows`` × :data:`DATA_TOKENS` random token ids (seed 0),
    the data of the methods that read data (their statistics' cost, not their quality, is measured)."""
    import torch
    from safetensors.torch import save_file
    path = Path(directory) / "data.safetensors"
    ids = torch.randint(0, vocab, (rows, DATA_TOKENS), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(path))
    return str(path)

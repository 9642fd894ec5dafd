"""Constants of the scale benchmark (shapes, stages, sizes, mergekit pins), its log, the
environment its child processes run in and the measuring wrapper (one child's wall time, CPU
time and peak RSS: :func:`measure`)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..provenance import REPO_ROOT, log  # noqa: F401 - log: the scale benchmark's, re-exported

#: The module the stage runner re-enters as ``python -m ENTRY --_write ...`` / ``--_read ...``
#: (the hidden flags of :func:`benchmarks.bench_scale.main`).
ENTRY = "benchmarks.bench_scale"

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "scale.json"
DEFAULT_WORK = "/tmp/symgraph-scale"
GB = 1e9
SHARD_SIZE = "1GB"
MERGEKIT_VERSION = "0.1.5"
MERGEKIT_TORCH = "torch==2.13.0"  # the local CPU wheel; installed first so pip does not pull CUDA
MERGEKIT_SHARD_PARAMS = "500M"    # mergekit's --out-shard-size counts parameters (≈1 GB in bf16)

_COMMON = dict(vocab_size=32000, hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False)
#: The shapes: LlamaConfig keyword arguments.
SHAPES = {
    "tiny": dict(_COMMON, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, vocab_size=4096),
    "1b": dict(_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
               rms_norm_eps=1e-5),
    # 155.3 M parameters (embeddings and head 49.2 M of them): the size of the engine's memory
    # targets at a small budget (RegMean and REPAIR out of core at --memory-budget 256MB)
    "155m": dict(_COMMON, hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                 rms_norm_eps=1e-5),
    "7b": dict(_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
               rms_norm_eps=1e-5),
}
STAGES = ("read_cold", "read_warm", "mergekit_linear", "symgraph_none", "symgraph_weights", "symgraph_weights_exact",
          "symgraph_weights_discrete",
          "symgraph_weights_tol", "symgraph_activations", "symgraph_regmean", "symgraph_fisher", "symgraph_repair",
          "symgraph_weights_baseline")
BASELINE = "symgraph_weights_baseline"  # symgraph_weights' command run from another commit's tree
DATA_ROWS, DATA_TOKENS = 32, 128  # symgraph_activations' data: 4 batches of 8 rows


def child_env(**extra) -> dict:
    """The environment of a child process: this one's, transformers quiet and offline, plus ``extra``."""
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


#: The measuring wrapper: runs one child (its stdout/stderr to files, own process group), kills
#: the group on timeout, then prints wall time and RUSAGE_CHILDREN (= that child's figures).
_WRAPPER = r"""
import json, os, resource, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
t0 = time.perf_counter()
timed_out = False
with open(spec["stdout"], "wb") as o, open(spec["stderr"], "wb") as e:
    p = subprocess.Popen(spec["cmd"], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                         env=spec.get("env"), cwd=spec.get("cwd"), start_new_session=True)
    try:
        rc = p.wait(timeout=spec.get("timeout"))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = p.wait()
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "timed_out": timed_out, "wall_s": wall, "maxrss_kb": ru.ru_maxrss,
                  "user_s": ru.ru_utime, "sys_s": ru.ru_stime}))
"""


def measure(cmd, *, timeout: float | None = None, env=None, cwd=None, log_prefix=None) -> dict:
    """Run ``cmd`` in a fresh wrapper process; returns rc, timed_out, wall_s, user_s, sys_s,
    peak_rss_bytes (the child's ``ru_maxrss``), the child's stdout/stderr log paths and, on
    failure, ``error`` (the last non-empty stderr line)."""
    import tempfile
    own_logs = log_prefix is None
    if own_logs:
        log_prefix = os.path.join(tempfile.mkdtemp(prefix="bench-scale-"), "child")
    spec = {"cmd": [str(c) for c in cmd], "stdout": f"{log_prefix}.stdout", "stderr": f"{log_prefix}.stderr",
            "timeout": timeout, "env": env, "cwd": str(cwd) if cwd else None}
    res = subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(spec)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"measuring wrapper failed: {res.stderr.strip()[-500:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    kb = r.pop("maxrss_kb")
    r["peak_rss_bytes"] = kb if sys.platform == "darwin" else kb * 1024
    r["stdout_log"], r["stderr_log"] = spec["stdout"], spec["stderr"]
    if r["rc"] != 0 or r["timed_out"]:
        r["error"] = ("timed out after %.0f s" % timeout) if r["timed_out"] else last_line(spec["stderr"])
    if own_logs:
        r["stdout"] = Path(spec["stdout"]).read_text(errors="replace")
        r["stderr"] = Path(spec["stderr"]).read_text(errors="replace")
        shutil.rmtree(os.path.dirname(log_prefix), ignore_errors=True)
        del r["stdout_log"], r["stderr_log"]
    return r


_PROGRESS_BAR = re.compile(r"[^\n]*?\|[^|\n]*\|\s*\d+/\d+ \[[^\]\n]*\]")  # a tqdm line


def last_line(path) -> str | None:
    """The last non-empty line of a log, tqdm progress bars taken out."""
    try:
        text = Path(path).read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return None
    lines = [ln.strip() for ln in _PROGRESS_BAR.sub("\n", text).splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][-500:] if lines else None


_RATES = ("import json, torch; from benchmarks.provenance import matmul_gflops; "
          "print(json.dumps(matmul_gflops((torch.float32, torch.bfloat16))))")


def matmul_rates(env=None) -> dict | None:
    """The machine's float32 and bfloat16 matmul rates now (GFLOP/s, 4096², best of 3) in a
    fresh process with the merges' threads: the yardstick of a run's seconds on a machine whose
    speed drifts (a 2-core cloud VM's float32 rate moved between 110 and 180 GFLOP/s in one
    session). None where the probe fails."""
    r = subprocess.run([sys.executable, "-c", _RATES], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (ValueError, IndexError):
        return None

"""The scale benchmark's constants (shapes, stages, sizes), the environment of its child processes,
the measuring wrapper (one child's wall time, CPU time and peak RSS) and mergekit (the baseline)
in its own venv."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..harness import run_logged
from ..provenance import REPO_ROOT, log

ENTRY = "benchmarks.bench_scale"  # re-entered as ``python -m ENTRY --_write ...`` / ``--_read ...``

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "scale.json"
DEFAULT_WORK = "/tmp/symgraph-scale"
GB = 1e9
SHARD_SIZE = "1GB"
MERGEKIT_VERSION = "0.1.5"
MERGEKIT_TORCH = "torch==2.13.0"  # the local CPU wheel; installed first so pip does not pull CUDA
MERGEKIT_SHARD_PARAMS = "500M"    # mergekit's --out-shard-size counts parameters (≈1 GB in bf16)

_COMMON = dict(vocab_size=32000, hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False, max_position_embeddings=2048, rms_norm_eps=1e-5)
#: The shapes: LlamaConfig keyword arguments.
SHAPES = {
    "tiny": dict(_COMMON, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
    "1b": dict(_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    # 155.3 M parameters (embeddings and head 49.2 M of them): the size of the engine's memory
    # targets at a small budget (RegMean and REPAIR out of core at --memory-budget 256MB)
    "155m": dict(_COMMON, hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
    "7b": dict(_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
}
STAGES = ("read_cold", "read_warm", "mergekit_linear", "symgraph_none", "symgraph_weights", "symgraph_weights_exact",
          "symgraph_weights_discrete", "symgraph_weights_tol", "symgraph_activations", "symgraph_regmean",
          "symgraph_fisher", "symgraph_repair", "symgraph_weights_baseline")
BASELINE = "symgraph_weights_baseline"  # symgraph_weights' command run from another commit's tree
DATA_ROWS, DATA_TOKENS = 32, 128  # symgraph_activations' data: 4 batches of 8 rows


def child_env(**extra) -> dict:
    """The environment of a child process: this one's, transformers quiet and offline, plus ``extra``."""
    return dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                **extra)


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
    peak_rss_bytes (the child's ``ru_maxrss``), and, on failure, ``error`` (the last non-empty
    stderr line); the child's output as ``stdout``/``stderr``, or with ``log_prefix`` the paths of
    the logs it was written to (``stdout_log``/``stderr_log``)."""
    tmp = None if log_prefix else tempfile.mkdtemp(prefix="bench-scale-")
    log_prefix = log_prefix or os.path.join(tmp, "child")
    spec = {"cmd": [str(c) for c in cmd], "stdout": f"{log_prefix}.stdout", "stderr": f"{log_prefix}.stderr",
            "timeout": timeout, "env": env, "cwd": str(cwd) if cwd else None}
    res = subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(spec)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"measuring wrapper failed: {res.stderr.strip()[-500:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    r["peak_rss_bytes"] = r.pop("maxrss_kb") * 1024
    if r["rc"] != 0 or r["timed_out"]:
        r["error"] = f"timed out after {timeout:.0f} s" if r["timed_out"] else last_line(spec["stderr"])
    if tmp is None:
        r["stdout_log"], r["stderr_log"] = spec["stdout"], spec["stderr"]
    else:
        r["stdout"], r["stderr"] = (Path(spec[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
        shutil.rmtree(tmp, ignore_errors=True)
    return r


_PROGRESS_BAR = re.compile(r"[^\n]*?\|[^|\n]*\|\s*\d+/\d+ \[[^\]\n]*\]")  # a tqdm line


def last_line(path) -> str | None:
    """The last non-empty line of a log, tqdm progress bars taken out."""
    text = Path(path).read_text(errors="replace").replace("\r", "\n")
    lines = [ln.strip() for ln in _PROGRESS_BAR.sub("\n", text).splitlines() if ln.strip()]
    return lines[-1][-500:] if lines else None


_RATES = "import json; from benchmarks.provenance import matmul_rates; print(json.dumps(matmul_rates(4096)))"


def matmul_rates(env=None) -> dict | None:
    """The machine's float32 and bfloat16 matmul rates now (GFLOP/s, up to 4096², best of 3:
    :func:`benchmarks.provenance.matmul_rates`, which sizes a slow bfloat16 down) in a fresh
    process with the merges' threads: the yardstick of a run's seconds on a machine whose speed
    drifts. None where the probe fails."""
    r = subprocess.run([sys.executable, "-c", _RATES], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def ensure_mergekit(venv: Path) -> tuple[Path | None, str]:
    """``(mergekit-yaml, message)``: mergekit in its own venv, created on demand."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe, f"mergekit venv {venv}"
    log(f"  creating {venv} (torch CPU wheel, then mergekit=={MERGEKIT_VERSION}) ...")
    logf = venv.parent / "mergekit-install.log"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    venv.parent.mkdir(parents=True, exist_ok=True)
    failed = run_logged([[sys.executable, "-m", "venv", "--clear", str(venv)], pip + [MERGEKIT_TORCH],
                         pip + [f"mergekit=={MERGEKIT_VERSION}"]], logf)
    if failed:
        return None, f"could not install mergekit ({failed[-1]} failed; see {logf}): {last_line(logf)}"
    return exe, f"mergekit venv {venv} (created now)"


def mergekit_config(a, b) -> str:
    import yaml
    return yaml.safe_dump({"merge_method": "linear", "dtype": "bfloat16", "out_dtype": "bfloat16",
                           "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)]},
                          sort_keys=False)


def mergekit_version(venv: Path) -> str | None:
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version("
                        "'mergekit'), m.version('torch'), m.version('transformers'))"], capture_output=True, text=True)
    return r.stdout.strip() or None

"""The measuring wrapper: one child process's wall time, CPU time and peak RSS."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..provenance import REPO_ROOT

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
        r["error"] = ("timed out after %.0f s" % timeout) if r["timed_out"] else _last_line(spec["stderr"])
    if own_logs:
        r["stdout"] = Path(spec["stdout"]).read_text(errors="replace")
        r["stderr"] = Path(spec["stderr"]).read_text(errors="replace")
        shutil.rmtree(os.path.dirname(log_prefix), ignore_errors=True)
        del r["stdout_log"], r["stderr_log"]
    return r


_PROGRESS_BAR = re.compile(r"[^\n]*?\|[^|\n]*\|\s*\d+/\d+ \[[^\]\n]*\]")  # a tqdm line


def _last_line(path) -> str | None:
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

"""What every benchmark measures the same way: the machine it ran on (:func:`machine_info`) and
this process's peak resident memory (:func:`peak_rss_mb`); the sampled peak of a code region
is :func:`benchmarks.speed.peak_rss`, a child process's is :func:`benchmarks.scale.common.measure`.
Commands run one after the other into a log (a peer's venv made): :func:`run_logged`; a
benchmark's ``main`` run as a command: :func:`script`."""
from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

GB = 1024 ** 3

__all__ = ["machine_info", "peak_rss_mb", "sync", "run_logged", "script"]


def machine_info() -> dict:
    import torch
    mem = None
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem = int(ln.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor() or None
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers
    return {"cores": os.cpu_count(), "ram_gb": mem / GB if mem else None, "cpu": cpu,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": "cpu",
            "cuda_available": torch.cuda.is_available(), "platform": platform.platform()}


def sync(device) -> None:
    """Waits for ``device``'s queued work (CUDA runs asynchronously; elsewhere: nothing to wait for)."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float:
    """This process's peak resident set so far (``ru_maxrss``), in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def run_logged(commands, log_file) -> list | None:
    """Runs ``commands`` (argument lists) one after the other, each one's command line and output
    written into ``log_file``, until one fails; that one (None: every one succeeded)."""
    with open(log_file, "w") as lf:
        for cmd in commands:
            lf.write("$ " + " ".join(map(str, cmd)) + "\n")
            lf.flush()
            if subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT).returncode != 0:
                return cmd
    return None


def script(main, *args) -> None:
    """Exits with ``main(*args)``'s status (an integer; any other result: 0), run as ``python -m
    benchmarks NAME`` runs it: transformers' log at errors only, warnings not shown."""
    import warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    status = main(*args)
    sys.exit(status if isinstance(status, int) else 0)

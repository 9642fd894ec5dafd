"""What every benchmark measures the same way: the machine (:func:`machine_info`), this process's
peak resident memory (:func:`peak_rss_mb`; a code region's sampled peak is
:func:`benchmarks.speed.peak_rss`, a child's :func:`benchmarks.scale.common.measure`), commands
run in order into a log (:func:`run_logged`) and a benchmark's ``main`` run as a command (:func:`script`)."""
from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

GB = 1024 ** 3


def _proc(path: str, key: str) -> str | None:
    """The value of the first ``key ...: value`` line of ``path`` (None: no such file or line)."""
    try:
        return next((ln.split(":", 1)[1].strip() for ln in Path(path).read_text().splitlines() if ln.startswith(key)),
                    None)
    except OSError:
        return None


def machine_info() -> dict:
    import torch
    import transformers
    mem = _proc("/proc/meminfo", "MemTotal:")
    return {"cores": os.cpu_count(), "ram_gb": int(mem.split()[0]) * 1024 / GB if mem else None,
            "cpu": _proc("/proc/cpuinfo", "model name") or platform.processor() or None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": "cpu",
            "cuda_available": torch.cuda.is_available(), "platform": platform.platform()}


def sync(device) -> None:
    """Waits for ``device``'s queued work (CUDA runs asynchronously; elsewhere nothing to wait for)."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float:
    """This process's peak resident set so far (``ru_maxrss``), in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def run_logged(commands, log_file) -> list | None:
    """Runs ``commands`` (argument lists) in order, each one's command line and output written into
    ``log_file``, until one fails; that one (None: all succeeded)."""
    with open(log_file, "w") as lf:
        for cmd in commands:
            lf.write("$ " + " ".join(map(str, cmd)) + "\n")
            lf.flush()
            if subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT).returncode != 0:
                return cmd
    return None


def script(main, *args) -> None:
    """Exits with ``main(*args)``'s status (an integer; any other result: 0), transformers' log at
    errors only and warnings not shown, as ``python -m benchmarks NAME`` runs it."""
    import warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    status = main(*args)
    sys.exit(status if isinstance(status, int) else 0)

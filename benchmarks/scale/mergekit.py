"""mergekit (the baseline) in its own venv, created on demand, and its linear-merge config."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..harness import run_logged
from .common import MERGEKIT_TORCH, MERGEKIT_VERSION, last_line, log


def ensure_mergekit(venv: Path) -> tuple[Path | None, str]:
    """``(mergekit-yaml, message)``: mergekit in its own venv, created on demand."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe, f"mergekit venv {venv}"
    log(f"  creating {venv} (torch CPU wheel, then mergekit=={MERGEKIT_VERSION}) ...")
    logf = venv.parent / "mergekit-install.log"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        failed = run_logged([[sys.executable, "-m", "venv", "--clear", str(venv)], pip + [MERGEKIT_TORCH],
                             pip + [f"mergekit=={MERGEKIT_VERSION}"]], logf)
    except OSError as e:
        return None, f"could not create the mergekit venv {venv}: {e}"
    if failed:
        return None, f"could not install mergekit ({failed[-1]} failed; see {logf}): {last_line(logf)}"
    if not exe.exists():
        return None, f"mergekit installed but {exe} is missing (see {logf})"
    return exe, f"mergekit venv {venv} (created now)"


def mergekit_config(a, b) -> str:
    import yaml
    cfg = {"merge_method": "linear", "dtype": "bfloat16", "out_dtype": "bfloat16",
           "models": [{"model": str(a), "parameters": {"weight": 0.5}},
                      {"model": str(b), "parameters": {"weight": 0.5}}]}
    return yaml.safe_dump(cfg, sort_keys=False)


def mergekit_version(venv: Path) -> str | None:
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import importlib.metadata as m; print(m.version('mergekit'), m.version('torch'), "
                        "m.version('transformers'))"], capture_output=True, text=True)
    return r.stdout.strip() or None

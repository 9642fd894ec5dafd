"""Where a benchmark result comes from (the repository and the commit it was run at), and
how a result is written (JSON without NaN or numpy scalars)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from symgraph.checkpoints.outdir import identity, remove_own

__all__ = ["REPO_ROOT", "git_state", "jsonable", "write_json", "staged"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_state() -> str | None:
    """The repository's HEAD commit, with "+dirty" when symgraph/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "symgraph"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def jsonable(x):
    """``x`` with non-finite floats as None and numpy scalars as Python numbers (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy / torch scalars
        return jsonable(x.item())
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(path, obj) -> None:
    """``obj`` (made :func:`jsonable`) into ``path``."""
    Path(path).write_text(json.dumps(jsonable(obj), indent=1))


@contextlib.contextmanager
def staged(out, prefix: str = ".bench-"):
    """A temporary sibling of ``out`` to write a result into; on success every file in it is
    moved into ``out`` (each one atomically replaced). The temporary directory, the only thing
    ever deleted, goes in any case."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    made = identity(tmp)
    try:
        yield tmp
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    finally:
        remove_own(str(tmp), made, prefix)


def write_result(out, prefix: str, record, markdown, plot=None, json_name: str = "results.json",
                 md_name: str = "report.md") -> None:
    """``record`` as JSON, its ``markdown(record)`` report and ``plot(record, dir)``'s figures,
    written into ``out`` through :func:`staged`."""
    with staged(out, prefix) as tmp:
        write_json(tmp / json_name, record)
        (tmp / md_name).write_text(markdown(record))
        if plot is not None:
            plot(record, tmp)

"""Where a benchmark result comes from: the repository and the commit it was run at."""
from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["REPO_ROOT", "git_state"]

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

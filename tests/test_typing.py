"""The package's annotations hold: mypy (configured in pyproject.toml's ``[tool.mypy]``: default
strictness, missing stubs ignored) reports no error on ``symgraph/``, and the package ships
``py.typed`` so that type checkers read them."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_package_is_marked_typed():
    assert (ROOT / "symgraph" / "py.typed").exists()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_mypy_is_clean():  # ~45 s on 2 cores without .mypy_cache, a few with it
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    errors = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    assert r.returncode == 0 and errors == [], "\n".join(errors or [r.stdout[-2000:], r.stderr[-2000:]])

"""The documentation site builds: ``mkdocs build --strict`` (material theme, mkdocstrings'
API reference) with no network and no warning, every page in the navigation, and the generated
pages equal to what their generators print now."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
              "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": "", "HF_HUB_OFFLINE": "1",
              "NO_MKDOCS_2_WARNING": "1"}


def _nav_pages(nav) -> list:
    out = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_site_builds_strict_offline_without_warnings(tmp_path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, **NO_NETWORK}, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    warnings = [ln for ln in log.splitlines() if re.search(r"\b(WARNING|ERROR)\b", ln)]
    assert warnings == [], "\n".join(warnings)
    assert time.perf_counter() - t0 < 120
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("symgraph.report.api.analyze", "symgraph.alignment.driver.align", "symgraph.merging.driver.merge",
                 "symgraph.app.run.merge_checkpoints", "symgraph.report.symmetry.SymmetryReport"):
        assert f'id="{name}"' in api, f"the API page lost {name}"


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages
    for page in ("concepts.md", "cli.md", "api.md", "scale.md", "troubleshooting.md"):
        assert page in nav


def test_command_line_page_is_generated():
    """In a fresh process: the page lists the built-in merge methods only (a test in this
    process may have registered one)."""
    r = subprocess.run([sys.executable, "-m", "symgraph.cli.reference"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **NO_NETWORK}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == r.stdout, \
        "regenerate: python -m symgraph.cli.reference > docs/cli.md"


def test_command_line_page_names_every_subcommand_and_option():
    from symgraph.cli.main import build_parser
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert f"## symgraph {name}" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "--debug"):
                    assert f"`{flag}" in page or f", {flag}" in page, (name, flag)

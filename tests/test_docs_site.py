"""The documentation site holds the benchmark results (issue 62): every results page, plot and
record of ``benchmarks/results/`` is rendered under ``results/`` by the mkdocs hook
``benchmarks/results_site.py``, the documentation's links to them work, and a link in the
site that leads nowhere fails this test (the known exceptions below are named, each a file
a page names that is missing from the repository, not a link the site breaks)."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from test_docs_build import NO_NETWORK, ROOT

#: (page, link) pairs that lead nowhere because the file is not in the repository: the plots
#: of benchmarks/results/full_groups/report.md were never committed (its record.json names
#: the command that draws them); docs/rotate.md links a results page issue 64 has not committed
#: yet. Anything else that leads nowhere fails.
KNOWN_MISSING = {("results/full_groups/report.md", n) for n in (
    "barrier_gpt2.png", "barrier_llama.png", "barrier_bert.png", "barrier_vit.png", "attention_correlation.png",
    "class_graph_llama.png")} | {("rotate.md", "results/rotate/rotate.md")}
BROKEN = re.compile(r"Doc file '([^']+)' contains (?:a link|an unrecognized relative link|an absolute link) "
                    r"'([^']+)'(?:, but the target (?:'[^']*' )?is not found|, it was left as is)")


def build(config: pathlib.Path, site: pathlib.Path) -> str:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                        str(site)], cwd=config.parent, capture_output=True, text=True,
                       env={**os.environ, **NO_NETWORK}, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def broken(log: str) -> set:
    """The (page, link) pairs mkdocs found leading nowhere (a missing target, a relative link it
    cannot resolve, an absolute path on the machine that built it)."""
    return {(m.group(1), m.group(2)) for m in BROKEN.finditer(log)
            if not m.group(2).startswith(("http://", "https://", "mailto:"))}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    return out, build(ROOT / "mkdocs.yml", out)


def test_no_link_in_the_site_leads_nowhere(site):
    _, log = site
    found = broken(log)
    absolute = {(p, link) for p, link in found if link.startswith("/")}
    assert found - absolute <= KNOWN_MISSING, sorted(found - absolute - KNOWN_MISSING)
    for page, link in KNOWN_MISSING - {("rotate.md", "results/rotate/rotate.md")}:
        assert not (ROOT / "benchmarks" / page).parent.joinpath(link).exists(), f"{link} is back: drop it from KNOWN"
    assert {p for p, _ in absolute} <= {"results/quick/report.md"}, absolute  # machine paths in a generated report


def test_results_pages_and_plots_are_in_the_site(site):
    out, _ = site
    results = ROOT / "benchmarks" / "results"
    pages = sorted(results.rglob("*.md"))
    assert len(pages) > 30
    for p in pages:
        rel = p.relative_to(results).with_suffix("")
        html = out / "results" / (rel.parent if rel.name in ("README", "index") else rel) / "index.html"
        assert html.exists(), html
    for plot in results.rglob("*.png"):
        assert (out / "results" / plot.relative_to(results)).stat().st_size == plot.stat().st_size
    suite = (out / "results" / "suite" / "report" / "index.html").read_text(encoding="utf-8")
    assert re.search(r'<img [^>]*src="\.\./barrier_llama\.png"', suite), "the suite's plots on its page"
    bench = (out / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert 'href="../results/suite/report/"' in bench and "../benchmarks/results/" not in bench
    assert (out / "results" / "index.html").exists() and (out / "results" / "untied" / "index.html").exists()


def test_a_broken_link_is_caught(tmp_path):
    """The check above is not vacuous: a page linking a results page and a page that do not
    exist is reported."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "broken.md").write_text("# Broken\n\n[a](../benchmarks/results/nowhere/report.md) and [b](nowhere.md)\n")
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    cfg["nav"].append({"Broken": "broken.md"})
    cfg["hooks"] = [str(ROOT / "benchmarks" / "results_site.py")]
    cfg["plugins"] = ["search"]  # the API page's reference is not what this test is about
    (docs / "api.md").write_text("# API\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(cfg))
    found = broken(build(tmp_path / "mkdocs.yml", tmp_path / "site"))
    assert {("broken.md", "results/nowhere/report.md"), ("broken.md", "nowhere.md")} <= found, found

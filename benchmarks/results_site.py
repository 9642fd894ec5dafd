"""A mkdocs hook (``hooks:`` in mkdocs.yml): the results pages, plots and records of
``benchmarks/results/`` (outside ``docs/``, each beside the record of the command that wrote it)
in the site under ``results/``, with an index page for each directory without a report of its
own, and the documentation's links to them (``../benchmarks/results/...``) pointed at those
copies. ``tests/test_docs_build.py`` fails on a link in the site that leads nowhere.
"""
from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SITE_DIR = "results"  # where they are in the site
KINDS = (".md", ".png", ".svg", ".json", ".csv")
LINK = re.compile(r"\]\((?:\.\./)+benchmarks/results/([^)#\s]*)(#[^)\s]*)?\)")


def _report(path: str) -> str | None:
    """A directory's own report: its ``report.md``, ``README.md`` or only page."""
    pages = sorted(n for n in os.listdir(path) if n.endswith(".md"))
    return next((n for n in ("report.md", "README.md") if n in pages), pages[0] if len(pages) == 1 else None)


def page_of(rel: str) -> str:
    """The site page of ``rel`` (a path under the results directory, ``""`` for itself): a file
    as it is, a directory's report, else its index."""
    rel = rel.strip("/")
    path = os.path.join(RESULTS, rel)
    if not os.path.isdir(path):
        return rel
    page = _report(path) if rel else None
    return f"{rel}/{page}" if rel and page else f"{rel}/index.md".lstrip("/")


def on_files(files, config):
    """Every results page, plot and record of ``benchmarks/results`` as a file of the site, and
    the index pages (:func:`page_of`)."""
    for root, dirs, names in os.walk(RESULTS):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(KINDS):
                rel = os.path.relpath(os.path.join(root, name), os.path.dirname(RESULTS)).replace(os.sep, "/")
                files.append(File(rel, os.path.dirname(RESULTS), config["site_dir"], config["use_directory_urls"]))
        rel = os.path.relpath(root, RESULTS).replace(os.sep, "/").removeprefix(".")
        if page_of(rel).endswith("index.md"):
            files.append(File.generated(config, f"{SITE_DIR}/{page_of(rel)}", content=_index(root, rel)))
    return files


def _index(root: str, rel: str) -> str:
    """A directory's index page: its pages and subdirectories, linked."""
    pages = sorted(n for n in os.listdir(root) if n.endswith(".md"))
    subs = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
    lines = [f"# Benchmark results{f': {rel}' if rel else ''}", "",
             "Each page was written by the command its directory's record.json names.", ""]
    lines += [f"- [{n[:-3]}]({n})" for n in pages]
    lines += [f"- [{n}/]({page_of(f'{rel}/{n}').removeprefix(f'{rel}/').lstrip('/')})" for n in subs]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown, page, config, files):
    """The documentation's links into ``benchmarks/results`` pointed at the site's copies."""
    src = page.file.src_uri
    if src.startswith(f"{SITE_DIR}/"):
        return markdown
    up = "../" * src.count("/")
    return LINK.sub(lambda m: f"]({up}{SITE_DIR}/{page_of(m.group(1))}{m.group(2) or ''})", markdown)

"""Every example in README.md and docs/*.md runs.

Each page's fenced blocks run in order, in one namespace, in a fresh working directory:
```python blocks are executed; in ```bash / ```console blocks every line is a ``symgraph ...``
command, run through the command's entry point in this process (exit code 0 expected). A block
whose previous line is ``<!-- file: NAME -->`` is written to NAME (a YAML config a later command
reads). A block whose previous line is ``<!-- not run: REASON -->`` (a GPU, ``torchrun``, a
package install, hours of training) is skipped, and the reason must be given. Any other
language (``text``: a listing or a diagram) is not code. The examples use tiny models, so the
whole file runs in well under a minute."""
from __future__ import annotations

import pathlib
import re
import shlex
import signal

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash", "console", "sh", "shell"}
MARK = re.compile(r"^<!--\s*(not run|file):(.*?)-->\s*$")


def blocks(path: pathlib.Path) -> list:
    """``[(language, code, marker, reason_or_file, line)]`` of every fenced block of ``path``."""
    lines, out, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, j = i, i + 1
        while j < len(lines) and not lines[j].startswith(fence.group(1)):
            j += 1
        mark = MARK.match(lines[start - 1].strip()) if start else None
        out.append((fence.group(2).lower(), "\n".join(lines[start + 1:j]) + "\n",
                    mark and mark.group(1), mark and mark.group(2).strip(), start + 1))
        i = j + 1
    return out


def commands(code: str) -> list:
    """The command lines of a shell block (``$ `` prompts, comments and continuations handled)."""
    joined = re.sub(r"\\\n", " ", code)
    lines = [ln.strip().removeprefix("$ ") for ln in joined.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_pages_are_found_and_markers_give_reasons():
    assert (ROOT / "README.md").exists() and len(PAGES) > 5
    for page in PAGES:
        for lang, code, mark, arg, line in blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            assert mark is None or arg, f"{where}: a `{mark}:` marker must say why (or which file)"
            if lang in {"bash", "console", "sh", "shell"} and mark is None:
                bad = [c for c in commands(code) if not c.startswith("symgraph ")]
                assert not bad, f"{where}: {bad} cannot run here; mark the block <!-- not run: why -->"
            if lang == "yaml":
                assert mark, f"{where}: a YAML block is a file a command reads (<!-- file: NAME -->) or not run"


def test_readme_keeps_the_ci_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'python -m pytest -q -m "not slow and not gpu" -n 2' in readme
    assert len(readme.splitlines()) <= 150


@pytest.fixture
def registry_restored():
    """A page may register a merge method; the registry is put back afterwards."""
    import symgraph
    from symgraph.merging.methods import registry
    symgraph.merge_methods()  # the built-in methods are registered before the snapshot
    saved = dict(registry._METHODS)
    yield
    registry._METHODS.clear()
    registry._METHODS.update(saved)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_examples_run(page, tmp_path, monkeypatch, registry_restored):
    from symgraph.cli.main import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__docs__"}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ran = 0
    for lang, code, mark, arg, line in blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if mark == "not run":
            continue
        if mark == "file":
            (tmp_path / arg).write_text(code, encoding="utf-8")
        elif lang == "python":
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the page's own example
            ran += 1
        elif lang in RUN:
            for cmd in commands(code):
                try:
                    rc = main(shlex.split(cmd, comments=True)[1:])
                finally:
                    for s, h in handlers.items():
                        signal.signal(s, h)
                assert rc in (0, None), f"{where}: `{cmd}` exited {rc}"
                ran += 1
    if ran == 0:
        pytest.skip("no runnable examples on this page")

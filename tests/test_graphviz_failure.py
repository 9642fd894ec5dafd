"""A failing external tool is one line (issue 60, class 7): ``symgraph analyze --png`` with a
Graphviz ``dot`` that cannot write PNG (a fake ``dot`` first on PATH that exits 1 with Graphviz's
message), or that writes nothing, is refused in one line naming ``--png``, the program and its
message; exit 2, no picture and no temporary file left, nothing else written."""
from __future__ import annotations

import pytest

from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)
NO_PNG = 'echo \'Format: "png" not recognized. Use one of: canon cmap dot\' >&2\nexit 1\n'


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphviz")
    (root / "work").mkdir()
    models.build("llama", seed=0, **L).save_pretrained(root / "inputs" / "a")
    return root


@pytest.mark.parametrize("script,needles", [
    (NO_PNG, ["exited with status 1", 'Format: "png" not recognized']),
    ("exit 0\n", ["wrote nothing"]),  # a dot that says it succeeded and writes no picture
], ids=["no_png_support", "writes_nothing"])
def test_failing_dot_is_one_line(ws, tmp_path, monkeypatch, capsys, script, needles):
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    before = digest(ws)
    r = main_in_process(ws, "analyze", ws / "inputs" / "a", "--png", ws / "work" / "g.png", capsys=capsys)
    refused(r, "--png: cannot draw", "g.png", f"Graphviz '{fake}' -Tpng", *needles, "expected a Graphviz that writes PNG")
    assert digest(ws) == before and not list((ws / "work").iterdir())  # no picture, no temporary file


def test_no_dot_draws_with_matplotlib(ws, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot at all: the matplotlib picture
    out = tmp_path / "g.png"
    r = main_in_process(ws, "analyze", ws / "inputs" / "a", "--png", out, capsys=capsys)
    assert r.returncode == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

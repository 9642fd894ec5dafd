"""``--quiet`` (issue 62): no progress bars, and none of our notes and warnings either, on every
command — what it prints on stdout and writes is unchanged, and a refusal still shows in its one
line. The notes and warnings come from anywhere in the package (a data file's unread key, data no
step uses, a fallback to loading the models); :func:`symgraph.core.progress.silenced` drops them
at stderr while ``main`` runs."""
from __future__ import annotations

import io
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from symgraph.cli.main import main
from symgraph.core import progress
from symgraph.testing import models

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    (root / "work").mkdir()
    for name, seed in (("a", 0), ("b", 1)):
        models.build("llama", seed=seed, **SIZES).save_pretrained(root / name)
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "labels": ids.clone()}, str(root / "data.safetensors"))  # labels: a key never read
    return root


def run(ws, capsys, *args):
    """``symgraph ARGS`` in this process, from ``ws/work``: its exit code, stdout and stderr."""
    import os
    capsys.readouterr()
    old = os.getcwd()
    os.chdir(ws / "work")
    try:
        rc = main([str(a) for a in args])
    finally:
        os.chdir(old)
    r = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=r.out, stderr=r.err)


def same_report(stdout: str, out: str) -> list:
    """``stdout``'s lines but those naming the output directory, without a last column of seconds."""
    return [re.sub(r"\s+[0-9.]+$", "", line) for line in stdout.splitlines() if out not in line]


# each command with what it says on stderr without --quiet (the one run here is not a terminal: no bars)
CASES = [
    (["merge", "{a}", "{b}", "--data", "{d}", "--out", "{o}"],
     ["symgraph: warning: --data", "is used by no step of this merge"]),
    (["compare", "tiny-llama", "tiny-llama", "--out-of-core", "--null", "0"],
     ["symgraph: note: --out-of-core needs two save_pretrained directories"]),
    (["barrier", "{a}", "{b}", "--data", "{d}", "--align", "none", "--points", "3"],
     ["symgraph: warning: data file", "which symgraph does not read"]),
]


@pytest.mark.parametrize("args, said", CASES, ids=["merge", "compare", "barrier"])
@pytest.mark.slow
def test_quiet_silences_our_notes_and_warnings(ws, capsys, args, said):
    fill = dict(a=ws / "a", b=ws / "b", d=ws / "data.safetensors")
    capsys.readouterr()
    loud = run(ws, capsys, *[x.format(o=ws / "loud", **fill) for x in args])
    assert loud.returncode == 0, loud.stderr
    for s in said:
        assert s in " ".join(loud.stderr.split()), (s, loud.stderr)
    out_loud = same_report(loud.stdout, "loud")
    for flag_first in (True, False):
        argv = [x.format(o=ws / f"quiet{flag_first}", **fill) for x in args]
        argv = ["--quiet", *argv] if flag_first else [*argv, "--quiet"]
        r = run(ws, capsys, *argv)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert same_report(r.stdout, "quiet") == out_loud


def test_quiet_merge_writes_the_same_model(ws, capsys):
    from safetensors.torch import load_file
    outs = {}
    for name, extra in (("m_loud", []), ("m_quiet", ["--quiet"])):
        r = run(ws, capsys, *extra, "merge", ws / "a", ws / "b", "--data", ws / "data.safetensors",
                "--out", ws / name)
        assert r.returncode == 0
        outs[name] = load_file(str(ws / name / "model.safetensors"))
    assert outs["m_loud"].keys() == outs["m_quiet"].keys()
    assert all(torch.equal(outs["m_loud"][k], outs["m_quiet"][k]) for k in outs["m_loud"])


def test_a_refusal_still_shows_with_quiet(ws, capsys):
    r = run(ws, capsys, "--quiet", "compare", ws / "a", ws / "nothing-here")
    assert r.returncode == 2
    assert r.stderr.count("symgraph:") == 1 and "nothing-here" in r.stderr and "Traceback" not in r.stderr


def test_silenced_drops_our_notes_and_python_warnings_only_when_quiet(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    progress.configure(active=False, quiet=True)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with progress.silenced():
                import sys
                progress.note("from note()")
                progress.note("something", "warning")
                warnings.warn("a Python warning", UserWarning)
                print("symgraph: 'x' is not a model; expected one", file=sys.stderr)  # a refusal
        assert not seen
        assert buf.getvalue() == "symgraph: 'x' is not a model; expected one\n"
    finally:
        progress.configure(active=False, quiet=False)
    with progress.silenced():  # not quiet: nothing dropped
        progress.note("kept")
    assert buf.getvalue().endswith("symgraph: note: kept\n")


def test_every_note_and_warning_of_the_package_goes_through_note():
    """A line beginning ``symgraph: note:`` or ``symgraph: warning:`` written any other way
    would escape ``--quiet``: no module but :mod:`symgraph.core.progress` spells one out."""
    from pathlib import Path
    root = Path(progress.__file__).resolve().parents[1]
    spelled = re.compile(r"""["']symgraph: (note|warning):""")
    found = [f"{p.relative_to(root.parent)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "progress.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert not found, f"notes written by hand (use symgraph.core.progress.note): {found}"

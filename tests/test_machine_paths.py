"""No tracked file names a machine's paths: no home directory (``/home/USER``, ``/Users/USER``,
``/root``, ``C:\\Users``) and no workspace (``/work``). A path a benchmark needs comes from an
option or an environment variable; a committed record writes the checkout as ``<repo>``
(``benchmarks.provenance.machine_free``) and other machine folders as ``<cache>`` or ``$OUT``."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a path starts the string or follows a space, quote, bracket, "=" or ":" (not a word, "~", "$"
# or another path: "$HOME/work/x" and "repo/work/" are not machine paths; "[o]" keeps this
# pattern from naming them itself)
MACHINE_PATH = re.compile(r"(?<![\w./~$-])(/home/[\w.-]+/|/Users/[\w.-]+/|/r[o]ot/|/w[o]rk/|[A-Za-z]:\\{1,2}Users\\{1,2})")


def machine_paths(text: str) -> list[str]:
    return [m.group(1) for m in MACHINE_PATH.finditer(text)]


def test_the_pattern_finds_machine_paths_and_nothing_else():
    # written in pieces, so that this file does not name them itself
    bs = chr(92)
    work, home, root = "/" + "work/", "/" + "home/alice/", "/" + "root/"
    win, win_json = "C:" + bs + "Users" + bs, "C:" + 2 * bs + "Users" + 2 * bs
    text = f'x = "{work}shared/a"; y="{home}x" {root}out {win}bob "{win_json}bob"'
    assert machine_paths(text) == [work, home, root, win, win_json]
    assert machine_paths("$HOME/work/x ~/work/y repo/work/z /tmp/work/ <repo>/a /homework/ /rooted") == []


def test_no_tracked_file_names_a_machine_path():
    try:
        ls = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"the tracked files are listed by git, and this tree has no repository ({e})")
    found = {}
    for name in ls.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:   # binary files (figures)
            continue
        if hits := machine_paths(text):
            found[name] = sorted(set(hits))
    assert not found, found


def test_written_records_name_the_checkout_as_repo(tmp_path):
    from benchmarks import provenance as pv
    pv.write_json(tmp_path / "r.json", {"out": str(pv.REPO_ROOT / "benchmarks" / "x"), "root": str(pv.REPO_ROOT),
                                        "home": str(Path.home() / "data")})
    import json
    assert json.loads((tmp_path / "r.json").read_text()) == {"out": "<repo>/benchmarks/x", "root": "<repo>",
                                                            "home": "~/data"}

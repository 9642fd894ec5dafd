"""Every results record names the command that regenerates it and a commit in this repository's
history: each file under ``benchmarks/results/`` is named by exactly one entry of the nearest
``record.json``, and the entry's commit is an ancestor of HEAD (``git cat-file -e`` and
``git merge-base --is-ancestor``). Needs the repository's full history: a shallow or absent
``.git`` fails with the reason, it does not skip."""
from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import provenance as pv


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(pv.REPO_ROOT), *args], capture_output=True, text=True)


def in_history(sha: str) -> bool:
    """Whether ``sha`` names a commit that is HEAD or one of its ancestors."""
    return (_git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
            and _git("merge-base", "--is-ancestor", sha, "HEAD").returncode == 0)


@pytest.fixture(scope="module")
def history():
    top = _git("rev-parse", "--is-shallow-repository")
    if top.returncode != 0:
        pytest.fail("the records' commits are checked against git history, and this tree has none "
                    f"({top.stderr.strip()}): run the tests in a clone of the repository")
    if top.stdout.strip() == "true":
        pytest.fail("this clone is shallow: the records' commits are older than its history "
                    "(git fetch --unshallow, or clone with full history as .ci/run's CI does)")
    return in_history


def test_every_results_file_names_its_command_and_an_existing_commit(history):
    problems = pv.record_problems(pv.RESULTS_ROOT, exists=history)
    assert not problems, "\n".join(problems)


def test_every_results_directory_has_its_record():
    dirs = [d for d in pv.RESULTS_ROOT.iterdir() if d.is_dir()]
    assert dirs and all((d / pv.RECORD).is_file() for d in dirs), [d.name for d in dirs if not (d / pv.RECORD).is_file()]
    assert (pv.RESULTS_ROOT / pv.RECORD).is_file()  # the files at the top


def test_a_record_without_a_command_says_why():
    for rec in pv.RESULTS_ROOT.rglob(pv.RECORD):
        for e in json.loads(rec.read_text())["entries"]:
            assert e["command"] or len(e.get("not_established", "")) > 20, (rec, e["files"])
            assert e["how"], (rec, e["files"])


def _record(root, entries):
    (root / pv.RECORD).write_text(json.dumps({"entries": entries}))


def test_the_check_finds_every_kind_of_fault(tmp_path):
    head = _git("rev-parse", "HEAD").stdout.strip()
    (tmp_path / "a").mkdir()
    for f in ("a/x.md", "a/y.json", "a/z.png", "top.json"):
        (tmp_path / f).write_text("{}")
    _record(tmp_path, [{"files": ["top.json"], "command": "python -m benchmarks.x", "commit": head}])
    _record(tmp_path / "a", [
        {"files": ["x.md", "y.json"], "command": "python -m benchmarks.y", "commit": head},
        {"files": ["y.json", "gone.md"], "command": "", "commit": "0" * 40},
    ])
    problems = pv.record_problems(tmp_path, exists=in_history)
    text = "\n".join(problems)
    assert "a/record.json entry 1: no command and no reason why none" in text
    assert "a/record.json entry 1: commit '" + "0" * 40 + "' is not in this repository's history" in text
    assert "a/record.json entry 1: gone.md does not exist" in text
    assert "a/y.json: named by 2 entries" in text      # two entries claim it
    assert "a/z.png: named by 0 entries" in text       # nobody claims it
    assert not any(p.startswith(("top.json", "a/x.md")) for p in problems), problems
    assert len(problems) == 5, problems


def test_a_file_is_owned_by_its_nearest_record_only(tmp_path):
    head = _git("rev-parse", "HEAD").stdout.strip()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_text("x")
    _record(tmp_path, [{"files": ["a/x.md"], "command": "python -m benchmarks.x", "commit": head}])
    assert pv.record_problems(tmp_path, exists=in_history) == []
    _record(tmp_path / "a", [])   # now a/record.json is the nearest, and it does not name x.md
    assert pv.record_problems(tmp_path, exists=in_history) == ["a/x.md: named by 0 entries of its nearest record.json"]


def test_add_record_takes_its_files_from_earlier_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAPH_COMMIT", "abc1234")
    pv.add_record(tmp_path, ["r.md", "r.json"], "python -m benchmarks.one")
    pv.add_record(tmp_path, ["s.md"], "python -m benchmarks.two", rates={"float32": 100.0})
    e = pv.add_record(tmp_path, ["r.json"], "python -m benchmarks.three --fast")
    entries = json.loads((tmp_path / pv.RECORD).read_text())["entries"]
    assert [(x["command"], x["files"]) for x in entries] == [
        ("python -m benchmarks.one", ["r.md"]),   # not rewritten: still the first run's
        ("python -m benchmarks.two", ["s.md"]), ("python -m benchmarks.three --fast", ["r.json"])]
    assert entries[1]["matmul_gflops"] == {"float32": 100.0}
    assert e == entries[2] and e["commit"] == "abc1234"
    pv.add_record(tmp_path, ["r.md", "s.md"], "python -m benchmarks.four")
    entries = json.loads((tmp_path / pv.RECORD).read_text())["entries"]
    assert [(x["command"], x["files"]) for x in entries] == [      # emptied entries go
        ("python -m benchmarks.three --fast", ["r.json"]), ("python -m benchmarks.four", ["r.md", "s.md"])]


def test_command_line_quotes_what_the_shell_would_split():
    assert pv.command_line(["--settings", "bf16 weights, exact", "--n", "3"], module="benchmarks.bench_sweeps") \
        == "python -m benchmarks.bench_sweeps --settings 'bf16 weights, exact' --n 3"


def test_table_aligns_columns():
    assert pv.table(["a", "b"], [[1, "x"], [2.5, None]], align=[None, "r"]) == [
        "| a | b |", "|---|---:|", "| 1 | x |", "| 2.5 | None |"]
    assert pv.markdown_table(["a"], [[1]], ["c"]) == "| a |\n|:---:|\n| 1 |"


def test_mean_sd_cells():
    """Mean ± sample standard deviation over the values that are there, as the reports write it."""
    assert pv.mean_sd([1.0, None, 2.0, 3.0]) == (2.0, 1.0, 3)
    assert pv.mean_sd([None]) == (None, None, 0) and pv.mean_sd([0.5]) == (0.5, 0.0, 1)
    assert pv.mean_sd_cell(pv.mean_sd([1.0, 2.0, 3.0])) == "2.000 ± 1.000"
    assert pv.mean_sd_cell(pv.mean_sd([0.12345]), 4) == "0.1235"
    assert pv.mean_sd_cell(pv.mean_sd([])) == "—"


def test_write_result_writes_the_files_and_their_record(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMGRAPH_COMMIT", raising=False)
    out = tmp_path / "r"

    def plot(rec, d):
        (d / "fig.png").write_bytes(b"png")
    pv.write_result(out, ".t-", {"x": float("nan"), "path": str(pv.REPO_ROOT / "a")},
                    lambda rec: "\n".join(pv.table(["x"], [[rec["x"]]])), plot, command="python -m benchmarks.t --n 1")
    assert json.loads((out / "results.json").read_text()) == {"x": None, "path": "<repo>/a"}
    assert (out / "report.md").read_text() == "| x |\n|---|\n| nan |"
    (e,) = json.loads((out / pv.RECORD).read_text())["entries"]
    assert e["files"] == ["fig.png", "report.md", "results.json"] and e["command"] == "python -m benchmarks.t --n 1"
    assert e["commit"] == pv.commit_info()["commit"] and in_history(e["commit"])  # the commit this process began at
    assert set(e["matmul_gflops"]) == {"float32", "bfloat16"} and all(v > 0 for v in e["matmul_gflops"].values())
    assert pv.record_problems(out, exists=in_history) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]   # the staging directory is gone


def test_a_json_result_alone_is_written_whole_with_its_record(tmp_path, monkeypatch):
    """``write_beside`` without a markdown: the JSON (strict, no machine path) and its entry only."""
    monkeypatch.delenv("SYMGRAPH_COMMIT", raising=False)
    pv.write_beside(tmp_path / "r" / "a.json", {"x": float("inf"), "p": str(pv.REPO_ROOT)}, command="python -m b")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["a.json", pv.RECORD]
    assert json.loads((tmp_path / "r" / "a.json").read_text()) == {"x": None, "p": "<repo>"}
    (e,) = json.loads((tmp_path / "r" / pv.RECORD).read_text())["entries"]
    assert e["files"] == ["a.json"] and e["command"] == "python -m b"


def test_a_copy_without_git_writes_no_record(tmp_path, monkeypatch):
    """On a lent device (SYMGRAPH_COMMIT, no .git) at most 8 files come back: no record.json
    there; the files are written as ever."""
    monkeypatch.setenv("SYMGRAPH_COMMIT", "abc1234")
    pv.write_beside(tmp_path / "d.json", {"a": 1}, "# d\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "d.md"]
    assert pv.register(tmp_path, ["d.json"]) is None


def test_the_record_command_adds_an_entry_by_hand(tmp_path, capsys):
    from benchmarks import __main__ as runner
    (tmp_path / "a.md").write_text("a")
    head = _git("rev-parse", "HEAD").stdout.strip()
    first = _git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    assert runner.main(["record", str(tmp_path), "a.md", "--command", "bash x.sh", "--commit", first[:10]]) == 0
    (e,) = json.loads((tmp_path / pv.RECORD).read_text())["entries"]
    assert (e["files"], e["command"], e["commit"]) == (["a.md"], "bash x.sh", first) and "matmul_gflops" not in e
    assert pv.record_problems(tmp_path, exists=in_history) == []
    assert runner.main(["record", str(tmp_path), "a.md", "--command", "c"]) == 0   # default: HEAD
    assert json.loads((tmp_path / pv.RECORD).read_text())["entries"][0]["commit"] == head
    capsys.readouterr()
    assert runner.main(["record", str(tmp_path), "b.md", "--command", "c"]) == 2
    assert runner.main(["record", str(tmp_path), "a.md", "--command", "c", "--commit", "0" * 40]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m benchmarks record: no b.md in {tmp_path}",
                   f"python -m benchmarks record: no commit {'0' * 40!r} in this repository"]


def test_a_record_names_the_commit_its_run_started_at(tmp_path, monkeypatch):
    """The tree moving on while a run works (a commit lands) does not change the commit its
    record names: the state of the tree when the process first asked."""
    monkeypatch.delenv("SYMGRAPH_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "one")
    first = pv.commit_info(tmp_path)
    (tmp_path / "f").write_text("2")
    git("commit", "-qam", "two")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() != first["commit"]
    assert pv.commit_info(tmp_path) == first and first["source"] == "git" and first["dirty"] is False


def test_a_venv_outside_the_checkout_is_written_venv(monkeypatch):
    """A record that names the interpreter's environment (an executable it ran) names no machine
    path when the venv lies outside the checkout; a system interpreter's prefix is left alone."""
    monkeypatch.setattr("sys.prefix", "/opt/envs/sg")
    monkeypatch.setattr("sys.base_prefix", "/usr")
    assert pv.machine_free('["/opt/envs/sg/bin/symgraph", "/opt/envs/sgx"]') == '["<venv>/bin/symgraph", "/opt/envs/sgx"]'
    monkeypatch.setattr("sys.prefix", "/usr")
    assert pv.machine_free('"/usr/bin/python"') == '"/usr/bin/python"'

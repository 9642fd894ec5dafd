"""``python -m benchmarks NAME``: the one runner finds every benchmark, hands it its arguments,
runs the suite when no name is given (as before) and refuses an unknown name with exit 2 and
one line."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from benchmarks import __main__ as runner
from benchmarks.provenance import REPO_ROOT


def test_every_bench_module_and_package_has_a_name():
    names = runner.benchmarks()
    files = {p.stem.removeprefix("bench_") for p in (REPO_ROOT / "benchmarks").glob("bench_*.py")}
    assert files and files <= set(names)
    assert {"suite", "anchor", "coverage", "align", "scale", "sweeps", "cost"} <= set(names)
    assert names["scale"] == "benchmarks.bench_scale" and names["suite"] == "benchmarks.suite"


def test_every_benchmark_has_a_main_taking_its_arguments():
    import inspect
    for name, mod in runner.benchmarks().items():
        main = importlib.import_module(mod).main
        assert list(inspect.signature(main).parameters)[:1] == ["argv"], name


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for mod, status in (("benchmarks.suite", None), ("benchmarks.bench_sweeps", 3)):
        m = importlib.import_module(mod)
        monkeypatch.setattr(m, "main", lambda argv, mod=mod, status=status: seen.append((mod, argv)) or status)
    return seen


def test_a_name_runs_that_benchmark_with_the_rest(calls):
    assert runner.main(["sweeps", "--out", "x.json"]) == 3
    assert calls == [("benchmarks.bench_sweeps", ["--out", "x.json"])]


def test_no_name_or_flags_first_run_the_suite(calls):
    assert runner.main([]) == 0
    assert runner.main(["--quick", "--no-cnn"]) == 0
    assert runner.main(["suite", "--quick"]) == 0
    assert calls == [("benchmarks.suite", []), ("benchmarks.suite", ["--quick", "--no-cnn"]),
                     ("benchmarks.suite", ["--quick"])]


def test_list_names_them(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.split() == ["scale", "python", "-m", "benchmarks.bench_scale"] for ln in out)
    assert len(out) == len(runner.benchmarks())


def test_an_unknown_name_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "no_such_bench"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no benchmark named 'no_such_bench'" in lines[0] and "scale" in lines[0]

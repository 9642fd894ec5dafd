"""The output directory (issue 60, classes 2 and 4): ``--out`` vetted before any work (a name
the file system cannot hold, a mount point, too little free space: exit 2, one line, nothing
created, inputs untouched), and the temporary directory a killed run leaves beside ``--out``
removed by the next run on it (a real SIGKILL of a merge), never anything else."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple

import pytest
import torch

from symgraph.checkpoints import leftovers
from symgraph.checkpoints.leftovers import RUN_MARKER, process_start, sweep
from symgraph.checkpoints.loading import read_layout
from symgraph.checkpoints.outdir import MARKER, OLD_PREFIX, TMP_PREFIX, human_bytes
from symgraph.testing import models

from cli_helpers import ENV, digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("outdir")
    models.build("llama", seed=0, **L).save_pretrained(root / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "b")
    return root


def _main(cwd, *args, capsys, seconds=120):
    """``symgraph ARGS`` in this process from ``cwd`` (:func:`cli_helpers.main_in_process`)."""
    return main_in_process(pathlib.Path(cwd), *args, cwd=".", capsys=capsys, seconds=seconds)


# --- --out vetted before any work -------------------------------------------------------------


def test_a_300_byte_name_is_refused_at_once(pair, tmp_path, capsys):
    before = digest(pair)
    t0 = time.perf_counter()
    r = _main(tmp_path, "merge", pair / "a", pair / "b", "--out", tmp_path / ("x" * 300), capsys=capsys)
    seconds = time.perf_counter() - t0
    refused(r, "--out has a name of 300 bytes", "at most 255 bytes")
    assert seconds < 3, seconds  # before the headers are read, let alone the models
    assert os.listdir(tmp_path) == []
    assert digest(pair) == before


def test_a_long_name_in_the_middle_is_refused_too(pair, tmp_path, capsys):
    r = _main(tmp_path, "merge", pair / "a", pair / "b", "--out", tmp_path / ("é" * 150) / "o", capsys=capsys)
    refused(r, "--out has a name of 300 bytes")  # 150 two-byte characters
    assert os.listdir(tmp_path) == []


def test_a_mount_point_is_refused_before_any_work(pair, tmp_path, monkeypatch, capsys):
    """An (empty) mount point as --out: refused in one line, pointing inside it; nothing is
    written into it or beside it. (Mounting needs privileges a test does not have: the check
    asks ``os.path.ismount``, answered here for that directory.)"""
    volume = tmp_path / "volume"
    volume.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == str(volume) or real_ismount(p))
    reads = []
    monkeypatch.setattr("symgraph.checkpoints.inputs.local_layouts", lambda specs: reads.append(specs))
    before = digest(pair)
    r = _main(tmp_path, "merge", pair / "a", pair / "b", "--out", volume, "--force", capsys=capsys)
    refused(r, f"--out '{volume}' is a mount point", "a mount point cannot take",
             f"expected a directory inside it (e.g. --out '{volume / 'merged'}')")
    assert reads == []  # refused before a header was read
    assert sorted(os.listdir(tmp_path)) == ["volume"] and os.listdir(volume) == []
    assert digest(pair) == before


def test_too_little_free_space_is_refused_in_human_units(pair, tmp_path, monkeypatch, capsys):
    """The output would hold the anchor's tensors: more than the file system has free is
    refused before the alignment, in decimal units."""
    need = read_layout(str(pair / "a")).nbytes
    assert need == sum(p.numel() * p.element_size() for p in models.build("llama", seed=0, **L).parameters())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 1234, 1234))
    aligned = []
    monkeypatch.setattr("symgraph.app.run._engine", lambda *a, **k: aligned.append(a))
    before = digest(pair)
    r = _main(tmp_path, "merge", pair / "a", pair / "b", "--out", tmp_path / "o", capsys=capsys)
    refused(r, f"the merged model needs {human_bytes(need)} but its file system has 1.23 kB free",
             "expected room for the output")
    assert human_bytes(need).endswith(" kB") and aligned == []
    assert os.listdir(tmp_path) == [] and digest(pair) == before


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 1234, 80_560, 3 * 10 ** 9, 1.5e12)] == \
        ["512 B", "1.23 kB", "80.6 kB", "3 GB", "1.5 TB"]


# --- a killed run's leftovers --------------------------------------------------------------------


def _leftover(parent, name, out, **marker):
    d = parent / name
    d.mkdir(mode=0o700)
    (d / "model.safetensors").write_bytes(b"half a model")
    if marker is not None:
        run = {"pid": 1, "host": socket.gethostname(), "boot": leftovers._boot_id(), "start": 1,
               "token": "t", "created": 0.0, "dir": name, "out": str(out)}
        run.update(marker)
        (d / RUN_MARKER).write_text(json.dumps(run))
    return d


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_dead_runs_only(tmp_path, capsys):
    out = tmp_path / "o"
    me, parent_pid = os.getpid(), os.getppid()
    dead = _leftover(tmp_path, TMP_PREFIX + "dead", out, pid=_dead_pid())
    reused = _leftover(tmp_path, TMP_PREFIX + "reused", out, pid=me, start=process_start(me) + 1)
    rebooted = _leftover(tmp_path, TMP_PREFIX + "rebooted", out, pid=parent_pid, start=process_start(parent_pid),
                         boot="another-boot")
    live = _leftover(tmp_path, TMP_PREFIX + "live", out, pid=parent_pid, start=process_start(parent_pid))
    mine = _leftover(tmp_path, TMP_PREFIX + "mine", out, pid=me, start=process_start(me))
    elsewhere = _leftover(tmp_path, TMP_PREFIX + "elsewhere", out, pid=_dead_pid(), host="another-host")
    other_out = _leftover(tmp_path, TMP_PREFIX + "other", tmp_path / "p", pid=_dead_pid())
    copied = _leftover(tmp_path, TMP_PREFIX + "copied", out, pid=_dead_pid(), dir=TMP_PREFIX + "dead")
    unmarked = _leftover(tmp_path, TMP_PREFIX + "unmarked", out, marker=None)
    (unmarked / RUN_MARKER).unlink()
    (tmp_path / (TMP_PREFIX + "file")).write_text("not a directory")
    aside = tmp_path / (OLD_PREFIX + "x")  # a previous output, moved aside by a run killed in the swap
    aside.mkdir()
    (aside / MARKER).write_text("{}")
    removed = sweep(str(out), TMP_PREFIX, aside=OLD_PREFIX)
    assert sorted(removed) == sorted(map(str, (dead, reused, rebooted)))
    assert not any(os.path.lexists(d) for d in (dead, reused, rebooted))
    for d in (live, mine, elsewhere, other_out, copied, unmarked):
        assert sorted(os.listdir(d)) == sorted(["model.safetensors"] + ([RUN_MARKER] if d != unmarked else []))
    assert (tmp_path / (TMP_PREFIX + "file")).read_text() == "not a directory"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("symgraph: note: removed 3 temporary directories left beside --out by a killed")
    kept = err[1]
    assert kept.startswith("symgraph: note: left alone beside --out:")
    assert f"{live} (its run, process {parent_pid}, is still running)" in kept
    assert f"{elsewhere} (made by a run on host 'another-host'" in kept
    assert f"{copied} (its run marker does not match it)" in kept
    assert f"{unmarked} (no run marker" in kept
    assert f"{aside} (a previous output moved aside by a run stopped while replacing it)" in kept
    assert os.listdir(aside) == [MARKER]
    assert str(mine) not in kept and str(other_out) not in kept  # this process's own; another output's
    sweep(str(out), TMP_PREFIX, aside=OLD_PREFIX)
    assert capsys.readouterr().err == ""  # named once


SLOW_MERGE = """
import sys, time
from symgraph.checkpoints import sharded
add = sharded.ShardWriter.add
def slow(self, key, t):
    time.sleep(0.4)
    return add(self, key, t)
sharded.ShardWriter.add = slow
from symgraph.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_merge_leaves_what_the_next_run_removes(pair, tmp_path, capsys):
    """A merge killed by SIGKILL (the OOM killer) while it writes: the previous output stays
    intact and the killed run's temporary directory stays beside it; the next run with
    --force removes it, says so in one line, and replaces the output."""
    work = tmp_path / "work"
    work.mkdir()
    out = work / "o"
    r = _main(work, "merge", pair / "a", pair / "b", "--align", "none", "--out", out, capsys=capsys)
    assert r.returncode == 0, r.stderr
    previous, inputs = digest(out), digest(pair)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_MERGE, "merge", str(pair / "a"), str(pair / "b"),
                             "--align", "none", "--out", str(out), "--force"], env=ENV, cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, tmp = time.time() + 240, None
    try:
        while tmp is None and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
            tmp = next((work / n for n in os.listdir(work) if n.startswith(TMP_PREFIX)
                        and os.path.exists(work / n / RUN_MARKER)), None)
    finally:
        proc.kill()
        stderr = proc.communicate()[1]
    assert tmp is not None, stderr.decode()[-2000:]
    assert proc.returncode == -signal.SIGKILL
    marker = json.loads((tmp / RUN_MARKER).read_text())
    assert marker["pid"] == proc.pid and marker["out"] == str(out) and marker["dir"] == tmp.name
    assert digest(out) == previous  # intact until replaced
    r = _main(work, "merge", pair / "a", pair / "b", "--align", "none", "--out", out, "--force", capsys=capsys)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("symgraph:")]
    assert notes == [f"symgraph: note: removed 1 temporary directory left beside --out by a killed symgraph run: {tmp}"]
    assert sorted(os.listdir(work)) == ["o"]
    assert RUN_MARKER not in os.listdir(out) and RUN_MARKER not in json.loads((out / MARKER).read_text())["files"]
    assert digest(out) != previous and digest(out)["model.safetensors"] == previous["model.safetensors"]
    assert digest(pair) == inputs


def test_the_run_marker_appears_only_whole(tmp_path, monkeypatch):
    """A run killed while it writes its marker must not leave a half marker that no later run
    can read (the directory would then be left alone for good): the marker's name appears
    only once its whole text is written."""
    seen = []
    real = leftovers._this_run

    def watching(out, directory):
        seen.append(os.path.exists(os.path.join(directory, RUN_MARKER)))  # before anything is written
        return real(out, directory)

    monkeypatch.setattr(leftovers, "_this_run", watching)
    real_replace = os.replace

    def replacing(src, dst):
        seen.append(os.path.exists(dst))  # still absent while the text is being written
        assert json.loads(pathlib.Path(src).read_text())["dir"] == "run"
        return real_replace(src, dst)

    monkeypatch.setattr(leftovers.os, "replace", replacing)
    (tmp_path / "run").mkdir()
    leftovers.mark_run(str(tmp_path / "run"), None)
    assert seen == [False, False]
    assert os.listdir(tmp_path / "run") == [RUN_MARKER]
    assert json.loads((tmp_path / "run" / RUN_MARKER).read_text())["pid"] == os.getpid()
    leftovers.unmark_run(str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run") == []


def test_a_killed_runs_spilled_statistics_are_swept_too(tmp_path, capsys):
    """The statistics a merge spills beside --out (REGMEAN, Fisher, REPAIR) carry a run marker
    for no one output: closed, nothing is left; left by a dead run, the next run beside them
    removes them; this process's own, in use, are not touched."""
    from symgraph.merging.engine.sums import Spill
    spill = Spill(str(tmp_path))
    spill.put({"g": torch.ones(2, 2)})
    marker = json.loads((pathlib.Path(spill.dir) / RUN_MARKER).read_text())
    assert marker["out"] is None and marker["pid"] == os.getpid()
    assert sweep(str(tmp_path / "o"), TMP_PREFIX) == [] and os.path.isdir(spill.dir)  # ours, in use
    assert torch.equal(spill.get("g"), torch.ones(2, 2))
    spill.close()
    assert os.listdir(tmp_path) == []
    dead = Spill(str(tmp_path))
    dead.put({"g": torch.ones(2, 2)})
    path = pathlib.Path(dead.dir) / RUN_MARKER
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": _dead_pid()}))
    assert sweep(str(tmp_path / "o"), TMP_PREFIX) == [dead.dir]
    assert os.listdir(tmp_path) == []
    assert "removed 1 temporary directory" in capsys.readouterr().err

"""What the command-line tests share: the environment a subprocess runs in (``ENV``), a digest
of every file under a directory (inputs untouched, nothing written outside ``--out``), the
check that a run was refused in one paragraph (``refused``), and ``symgraph ARGS`` run in this
process (``main_in_process``: a subprocess each would spend seconds importing torch)."""
from __future__ import annotations

import hashlib
import os
import signal
from types import SimpleNamespace

from conftest import CLI_ENV as ENV

__all__ = ["ENV", "digest", "refused", "main_in_process"]


def digest(path):
    """Every file under ``path`` and its sha256."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def refused(r, *needles):
    """``r`` (a run's ``returncode`` and ``stderr``) exited 2 with one refusal and no traceback,
    and its message holds every one of ``needles`` (whitespace folded)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    refusals = r.stderr.count("symgraph:") - r.stderr.count("symgraph: warning") - r.stderr.count("symgraph: note")
    assert "Traceback" not in r.stderr and refusals == 1, r.stderr
    err = " ".join(r.stderr.split())
    for n in needles:
        assert n in err, (n, err)


def main_in_process(ws, *args, cwd="work", capsys, seconds=60):
    """``symgraph ARGS`` through the command's entry point in this process, from ``ws/cwd``:
    ``(returncode, stderr)`` like a subprocess's; a run over ``seconds`` fails the test."""
    from symgraph.cli.main import main

    def hang(*_):
        raise TimeoutError(f"symgraph {' '.join(map(str, args))} ran over {seconds} s")
    old_cwd, old = os.getcwd(), signal.signal(signal.SIGALRM, hang)
    os.chdir(ws / cwd)
    signal.alarm(seconds)
    try:
        rc = main([str(a) for a in args])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(old_cwd)
    return SimpleNamespace(returncode=rc, stderr=capsys.readouterr().err)

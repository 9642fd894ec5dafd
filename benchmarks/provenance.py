"""Where a benchmark result comes from and how it is written: the commit and the command it was
run with (each results directory's ``record.json``, checked by :func:`record_problems`), the
machine's matmul rates, results as JSON without NaN or numpy scalars, Markdown tables
(:func:`table`) and the progress log (:func:`log`)."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from symgraph.checkpoints.outdir import identity, remove_own

__all__ = ["REPO_ROOT", "RECORD", "RESULTS_ROOT", "git_state", "jsonable", "machine_free", "write_json", "staged",
           "write_result", "write_beside", "write_entry", "register", "log", "table", "markdown_table", "cell",
           "mean_sd", "mean_sd_cell",
           "pyplot", "save_figure", "commit_info",
           "command_line", "best_time", "matmul_gflops", "matmul_rates", "add_record", "record_problems"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_state() -> str | None:
    """The repository's HEAD commit, with "+dirty" when symgraph/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "symgraph"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def jsonable(x):
    """``x`` with non-finite floats as None and numpy scalars as Python numbers (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy / torch scalars
        return jsonable(x.item())
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def machine_free(text: str) -> str:
    """``text`` with this checkout's path written ``<repo>``, the running Python's environment
    (a venv outside the checkout) ``<venv>`` and the home directory ``~``: a committed record
    names no machine's paths (tests/test_machine_paths.py checks the tree)."""
    venv = sys.prefix if sys.prefix != sys.base_prefix else ""  # a venv's, never a system prefix
    for path, name in ((str(REPO_ROOT), "<repo>"), (venv, "<venv>"), (str(Path.home()), "~")):
        if len(path) > 1:
            text = text.replace(path + "/", name + "/").replace(f'"{path}"', f'"{name}"')
    return text


def write_json(path, obj) -> None:
    """``obj`` (made :func:`jsonable`, paths :func:`machine_free`) into ``path``."""
    Path(path).write_text(machine_free(json.dumps(jsonable(obj), indent=1)))


@contextlib.contextmanager
def staged(out, prefix: str = ".bench-"):
    """A temporary sibling of ``out`` to write a result into; on success every file in it is
    moved into ``out`` (each one atomically replaced). The temporary directory, the only thing
    ever deleted, goes in any case."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    made = identity(tmp)
    try:
        yield tmp
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    finally:
        remove_own(str(tmp), made, prefix)


def write_result(out, prefix: str, record, markdown, plot=None, json_name: str = "results.json",
                 md_name: str = "report.md", command: str | None = None) -> None:
    """``plot(record, dir)``'s figures (first: it may note them in ``record``), ``record`` as JSON
    and its ``markdown(record)`` report, written into ``out`` through :func:`staged`, and their
    entry in ``out``'s ``record.json`` (:func:`register`): ``command`` (default: this process's,
    :func:`command_line`), the commit, the machine's matmul rates."""
    with staged(out, prefix) as tmp:
        if plot is not None:
            plot(record, tmp)
        write_json(tmp / json_name, record)
        (tmp / md_name).write_text(markdown(record))
        names = [f.name for f in tmp.iterdir()]
    register(out, names, command)


def write_beside(path, record, markdown: str | None = None, command: str | None = None) -> None:
    """``record`` as JSON at ``path`` (:func:`write_json`'s form) and ``markdown``, when given,
    beside it (``.md``), each file replaced whole (a run stopped at any time leaves whole files),
    and their entry in the directory's ``record.json`` (:func:`register`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {path: machine_free(json.dumps(jsonable(record), indent=1))}
    if markdown is not None:
        files[path.with_suffix(".md")] = markdown
    for p, text in files.items():
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, p)
    register(path.parent, [p.name for p in files], command)


def write_entry(path, label: str, record, markdown) -> dict:
    """``record`` as entry ``label`` of the results at ``path`` (``{label: record}`` JSON, the
    other entries kept; what is not JSON written null), with ``markdown(all of them)`` beside it
    (:func:`write_beside`). Returns all the entries."""
    path = Path(path)
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[label] = record
    results = json.loads(json.dumps(results, default=lambda o: None))
    write_beside(path, results, markdown(results))
    return results


def register(out, files, command: str | None = None) -> dict | None:
    """:func:`add_record` with this process's command (:func:`command_line`) unless given, and the
    machine's matmul rates (:func:`matmul_rates`, measured once a process: call it before the
    runs it must not disturb). Not on a copy of the tree whose commit comes from
    ``$SYMGRAPH_COMMIT`` (a lent device: what comes back from it is a few files, and every one
    of them counts; the results name their commit, and their entry is added where they are
    committed): None there."""
    if commit_info()["source"] == "SYMGRAPH_COMMIT":
        return None
    return add_record(out, files, command or command_line(), rates=matmul_rates())


# --- the one logger and the one table writer ----------------------------------------------------


def log(msg: str) -> None:
    """A benchmark's progress line, on stderr (stdout stays for what a command prints)."""
    print(msg, file=sys.stderr, flush=True)


def table(header, rows, align=None) -> list[str]:
    """A Markdown table's lines: ``header`` (cells), ``rows`` (cells, each ``str()``-ed; a row
    given as a string is a line written as it is, e.g. one whose cells span by hand) and
    ``align``, one of ``"l"``, ``"r"``, ``"c"`` or ``None`` per column (``---``, ``---:``,
    ``:---:``, ``---``; None: every column ``---``)."""
    marks = {"l": ":---", "r": "---:", "c": ":---:", None: "---"}
    align = align or [None] * len(header)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|",
            *(row if isinstance(row, str) else "| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def markdown_table(header, rows, align=None) -> str:
    """:func:`table`'s lines as one string."""
    return "\n".join(table(header, rows, align))


def cell(x, spec: str = ".3f", none: str = "—") -> str:
    """A table cell: ``format(x, spec)``, or ``none`` where ``x`` is None."""
    return none if x is None else format(x, spec)


def mean_sd(xs) -> tuple:
    """``(mean, sample standard deviation, n)`` of the values in ``xs`` that are not None
    (sd 0 for one value; ``(None, None, 0)`` for none)."""
    import numpy as np
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0, len(xs)


def mean_sd_cell(ms, digits: int = 3) -> str:
    """A table cell of :func:`mean_sd`'s ``ms``: ``m ± s`` (``m`` for one value, ``—`` for none)."""
    m, s, n = ms
    if m is None:
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: a benchmark's figures are files, never a window."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110, **savefig) -> str:
    """``fig`` written to ``path`` (``savefig``'s keywords, e.g. ``bbox_inches="tight"``) and
    closed; the file's name."""
    fig.savefig(path, dpi=dpi, **savefig)
    pyplot().close(fig)
    return Path(path).name


# --- what a record names: the command and the commit ---------------------------------------------


def commit_info(root: Path = REPO_ROOT) -> dict:
    """``{"commit", "dirty", "source"}``: ``$SYMGRAPH_COMMIT`` (a copy of the tree without
    ``.git``, e.g. on a lent GPU machine), else ``git rev-parse HEAD`` and whether tracked files
    differ from it, as they were when this process first asked (a run names the commit it
    started at, even if the tree moves on while it runs; this module asks on import); ``commit``
    None when neither is there."""
    env = os.environ.get("SYMGRAPH_COMMIT")
    if env:
        return {"commit": env.strip(), "dirty": None, "source": "SYMGRAPH_COMMIT"}
    key = str(Path(root).resolve())
    if key not in _STARTED:
        _STARTED[key] = _git_state(root)
    return dict(_STARTED[key])


#: ``{tree: commit_info}``: each tree's state when this process first asked.
_STARTED: dict = {}


def _git_state(root) -> dict:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    except OSError:
        return {"commit": None, "dirty": None, "source": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None, "source": None}
    return {"commit": head.stdout.strip(), "dirty": bool(st.stdout.strip()) if st.returncode == 0 else None,
            "source": "git"}


def command_line(argv=None, module: str | None = None) -> str:
    """The command that ran: ``python -m MODULE ARGS`` (``argv`` defaults to ``sys.argv[1:]``;
    ``module`` to the running ``__main__``'s), each argument shell-quoted."""
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name.removesuffix(".__main__") if spec is not None else "benchmarks"
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *map(shlex.quote, args)])


#: The file in every directory under ``benchmarks/results/`` that names, for each of its files,
#: the command that regenerates it and the commit it was run at.
RECORD = "record.json"
RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"


def best_time(f, n=3, sync=lambda: None) -> float:
    """The best of ``n`` timed calls after one warm-up; ``sync``: an accelerator's synchronize."""
    f()
    sync()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_gflops(dtypes, n: int = 4096, device="cpu", sync=lambda: None) -> dict:
    """``{dtype name: GFLOP/s}`` of an ``n×n`` matmul on ``device``, best of 3 (:func:`best_time`)."""
    import torch
    out = {}
    for dt in dtypes:
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        out[str(dt)[6:]] = 2 * n ** 3 / best_time(lambda: a @ b, sync=sync) / 1e9
    return out


@functools.lru_cache(maxsize=None)
def matmul_rates(n: int = 2048) -> dict:
    """This machine's float32 and bfloat16 matmul rates, GFLOP/s (``n×n``, best of 3; measured
    once a process): the yardstick a record's seconds are read against. A dtype this machine
    multiplies slowly is measured at the size (from 256, doubling up to ``n``) whose product
    first takes 0.1 s: bfloat16 without AVX-512 BF16 runs at about 1 GFLOP/s, where 2048 would
    take a minute a call."""
    import torch
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        m = min(256, n)
        while m < n and _one_product(dt, m) < 0.1:
            m *= 2
        out.update(matmul_gflops((dt,), n=m))
    return {k: round(v, 1) for k, v in out.items()}


def _one_product(dtype, n: int) -> float:
    """Seconds of one ``n×n`` product in ``dtype`` (after a warm-up: :func:`best_time`)."""
    import torch
    a, b = (torch.randn(n, n).to(dtype) for _ in range(2))
    return best_time(lambda: a @ b, n=1)


def add_record(out, files, command: str, *, rates: dict | None = None, how: str = "written by the run",
               commit: str | None = None) -> dict:
    """The entry of ``out/record.json`` for ``files`` (names in ``out``): ``command``, this tree's
    commit (``commit``, default :func:`commit_info`'s) and, when given, the machine's matmul
    ``rates``. Earlier entries
    lose these files and keep the others (files this run did not rewrite keep the run that wrote
    them); an entry left with none goes. Returns the entry."""
    out = Path(out)
    info = commit_info() if commit is None else {"commit": commit, "dirty": None}
    entry = {"files": sorted(str(f) for f in files), "command": command, "commit": info["commit"],
             "commit_is": "run", "how": how}
    if info["dirty"]:
        entry["dirty"] = True
    if rates is not None:
        entry["matmul_gflops"] = dict(rates)
    path = out / RECORD
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    keep = [e | {"files": [f for f in e["files"] if f not in entry["files"]]} for e in old]
    keep = [e for e in keep if e["files"]]
    path.write_text(json.dumps({"entries": [*keep, entry]}, indent=1, ensure_ascii=False) + "\n")
    return entry


def _covering(path: Path, root: Path):
    """The nearest ``record.json`` at or above ``path``'s directory, up to ``root``."""
    d = path.parent
    while True:
        if (d / RECORD).is_file():
            return d
        if d == root:
            return None
        d = d.parent


def record_problems(root: Path = RESULTS_ROOT, exists=None) -> list[str]:
    """What is wrong with the records under ``root``, one line each (none: every file is named
    by exactly one entry of the nearest ``record.json``, every entry names files that exist, a
    command, or why there is none, and a commit for which ``exists(commit)`` holds)."""
    root = Path(root)
    problems, covered = [], {}
    for rec in sorted(root.rglob(RECORD)):
        try:
            entries = json.loads(rec.read_text())["entries"]
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"{rec.relative_to(root)}: not a record ({e})")
            continue
        for i, e in enumerate(entries):
            where = f"{rec.relative_to(root)} entry {i}"
            if not (isinstance(e.get("command"), str) and e["command"].strip()) and not e.get("not_established"):
                problems.append(f"{where}: no command and no reason why none")
            if not isinstance(e.get("commit"), str) or (exists is not None and not exists(e["commit"])):
                problems.append(f"{where}: commit {e.get('commit')!r} is not in this repository's history")
            if not e.get("files"):
                problems.append(f"{where}: names no files")
            for f in e.get("files") or ():
                p = (rec.parent / f).resolve()
                if not p.is_file():
                    problems.append(f"{where}: {f} does not exist")
                covered.setdefault(p, []).append((rec.parent, where))
    for p in sorted(q for q in root.rglob("*") if q.is_file() and q.name != RECORD):
        owners = [w for d, w in covered.get(p.resolve(), ()) if d == _covering(p, root)]
        if len(owners) != 1:
            problems.append(f"{p.relative_to(root)}: named by {len(owners)} entries of its nearest {RECORD}"
                            + (f" ({', '.join(owners)})" if owners else ""))
    return problems



def main(argv=None) -> int:
    """``python -m benchmarks record DIR FILE... --command CMD [--commit SHA]``: the entry of
    results brought back from a lent device (which writes none) or measured by hand, added to
    ``DIR/record.json``; the commit must be in this repository's history."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks record", description=main.__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--command", required=True, help="the command that regenerates the files")
    ap.add_argument("--commit", default="HEAD", help="the commit they ran at (default: HEAD)")
    ap.add_argument("--how", default="added by hand (python -m benchmarks record)")
    a = ap.parse_args(argv)
    missing = [f for f in a.files if not (Path(a.dir) / f).is_file()]
    sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "-q", f"{a.commit}^{{commit}}"],
                         capture_output=True, text=True).stdout.strip()
    if missing or not sha:
        why = f"no {', '.join(missing)} in {a.dir}" if missing else f"no commit {a.commit!r} in this repository"
        print(f"python -m benchmarks record: {why}", file=sys.stderr)
        return 2
    add_record(a.dir, a.files, a.command, how=a.how, commit=sha)
    return 0


commit_info()  # the commit this process starts at, whatever the tree holds when a run ends

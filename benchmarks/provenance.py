"""How a benchmark result is written and where it comes from: strict JSON naming no machine's
paths, Markdown tables, figures, the progress log, and each results directory's ``record.json``
(per file: the command that regenerates it, the commit it ran at, the machine's matmul rates;
checked by :func:`record_problems`; ``python -m benchmarks record`` adds an entry by hand)."""
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

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = "record.json"
RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"


def _git(*args, root=REPO_ROOT) -> str | None:
    """``git -C root ARGS``'s stripped stdout; None where git fails or is missing."""
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state() -> str | None:
    """The HEAD commit (short), with "+dirty" when symgraph/ has uncommitted changes."""
    head, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "--", "symgraph")
    return None if head is None or dirty is None else head + ("+dirty" if dirty else "")


def jsonable(x):
    """``x`` with non-finite floats as None and numpy / torch scalars as Python numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        return jsonable(x.item())
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def machine_free(text: str) -> str:
    """``text`` with this checkout's path written ``<repo>``, a venv's prefix ``<venv>`` and the
    home directory ``~`` (tests/test_machine_paths.py checks the tree)."""
    venv = sys.prefix if sys.prefix != sys.base_prefix else ""  # a venv's, never a system prefix
    for path, name in ((str(REPO_ROOT), "<repo>"), (venv, "<venv>"), (str(Path.home()), "~")):
        if len(path) > 1:
            text = text.replace(path + "/", name + "/").replace(f'"{path}"', f'"{name}"')
    return text


def write_json(path, obj) -> None:
    Path(path).write_text(machine_free(json.dumps(jsonable(obj), indent=1)))


@contextlib.contextmanager
def staged(out, prefix: str = ".bench-"):
    """A temporary sibling of ``out`` to write into; on success each of its files replaces its
    namesake in ``out`` atomically. Only the temporary directory is ever deleted."""
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
    and ``markdown(record)``, written into ``out`` through :func:`staged`, and :func:`register`-ed."""
    with staged(out, prefix) as tmp:
        if plot is not None:
            plot(record, tmp)
        write_json(tmp / json_name, record)
        (tmp / md_name).write_text(markdown(record))
        names = [f.name for f in tmp.iterdir()]
    register(out, names, command)


def write_beside(path, record, markdown: str | None = None, command: str | None = None) -> None:
    """``record`` as JSON at ``path`` and ``markdown``, when given, beside it (``.md``), each file
    replaced whole, and :func:`register`-ed."""
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
    """``record`` as entry ``label`` of the ``{label: record}`` JSON at ``path`` (other entries
    kept, what is not JSON null), ``markdown(all entries)`` beside it; returns all entries."""
    path = Path(path)
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[label] = record
    results = json.loads(json.dumps(results, default=lambda o: None))
    write_beside(path, results, markdown(results))
    return results


def register(out, files, command: str | None = None) -> dict | None:
    """:func:`add_record` with this process's command unless given and the machine's
    :func:`matmul_rates`. None, and no entry, on a copy of the tree with ``$SYMGRAPH_COMMIT``
    (a lent device: the entry is added where its results are committed)."""
    if commit_info()["source"] == "SYMGRAPH_COMMIT":
        return None
    return add_record(out, files, command or command_line(), rates=matmul_rates())


def log(msg: str) -> None:
    """A progress line, on stderr (stdout stays for what a command prints)."""
    print(msg, file=sys.stderr, flush=True)


def table(header, rows, align=None) -> list[str]:
    """A Markdown table's lines. Cells are ``str()``-ed; a row given as a string is a line as it
    is. ``align``: per column ``"l"``, ``"r"``, ``"c"`` or None (default: all None)."""
    marks = {"l": ":---", "r": "---:", "c": ":---:", None: "---"}
    align = align or [None] * len(header)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|",
            *(row if isinstance(row, str) else "| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def markdown_table(header, rows, align=None) -> str:
    return "\n".join(table(header, rows, align))


def cell(x, spec: str = ".3f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def mean_sd(xs) -> tuple:
    """``(mean, sample sd, n)`` of the values that are not None (sd 0 for one, ``(None, None, 0)`` for none)."""
    import numpy as np
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0, len(xs)


def mean_sd_cell(ms, digits: int = 3) -> str:
    """:func:`mean_sd`'s ``ms`` as ``m ± s`` (``m`` for one value, ``—`` for none)."""
    m, s, n = ms
    if m is None:
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110, **savefig) -> str:
    """``fig`` saved to ``path`` and closed; the file's name."""
    fig.savefig(path, dpi=dpi, **savefig)
    pyplot().close(fig)
    return Path(path).name


#: ``{tree: commit_info}``: each tree's state when this process first asked.
_STARTED: dict = {}


def commit_info(root: Path = REPO_ROOT) -> dict:
    """``{"commit", "dirty", "source"}``: ``$SYMGRAPH_COMMIT`` (a copy of the tree without
    ``.git``), else HEAD and whether tracked files differ from it as they were when this process
    first asked (a run names the commit it started at; this module asks on import)."""
    env = os.environ.get("SYMGRAPH_COMMIT")
    if env:
        return {"commit": env.strip(), "dirty": None, "source": "SYMGRAPH_COMMIT"}
    key = str(Path(root).resolve())
    if key not in _STARTED:
        head = _git("rev-parse", "HEAD", root=root)
        st = _git("status", "--porcelain", "--untracked-files=no", root=root)
        _STARTED[key] = {"commit": head, "dirty": None if head is None or st is None else bool(st),
                         "source": None if head is None else "git"}
    return dict(_STARTED[key])


def command_line(argv=None, module: str | None = None) -> str:
    """``python -m MODULE ARGS``, shell-quoted (defaults: the running ``__main__`` and ``sys.argv[1:]``)."""
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name.removesuffix(".__main__") if spec is not None else "benchmarks"
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *map(shlex.quote, args)])


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
    """``{dtype name: GFLOP/s}`` of an ``n×n`` matmul on ``device`` (:func:`best_time`)."""
    import torch
    out = {}
    for dt in dtypes:
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        out[str(dt)[6:]] = 2 * n ** 3 / best_time(lambda: a @ b, sync=sync) / 1e9
    return out


@functools.lru_cache(maxsize=None)
def matmul_rates(n: int = 2048) -> dict:
    """This machine's float32 and bfloat16 matmul GFLOP/s, measured once a process: the yardstick
    for a record's seconds. A slow dtype (bfloat16 without AVX-512 BF16: about 1 GFLOP/s) is
    measured at the first size from 256, doubling up to ``n``, whose product takes 0.1 s."""
    import torch
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        m = min(256, n)
        (name, rate), = matmul_gflops((dt,), n=m).items()
        while m < n and 2 * m ** 3 / rate / 1e9 < 0.1:
            m *= 2
            (name, rate), = matmul_gflops((dt,), n=m).items()
        out[name] = round(rate, 1)
    return out


def add_record(out, files, command: str, *, rates: dict | None = None, how: str = "written by the run",
               commit: str | None = None) -> dict:
    """The entry of ``out/record.json`` for ``files``: ``command``, the commit (default
    :func:`commit_info`'s), the matmul ``rates`` when given. Earlier entries lose these files;
    an entry left with none goes. Returns the entry."""
    info = commit_info() if commit is None else {"commit": commit, "dirty": None}
    entry = {"files": sorted(str(f) for f in files), "command": command, "commit": info["commit"],
             "commit_is": "run", "how": how}
    if info["dirty"]:
        entry["dirty"] = True
    if rates is not None:
        entry["matmul_gflops"] = dict(rates)
    path = Path(out) / RECORD
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    keep = [e | {"files": [f for f in e["files"] if f not in entry["files"]]} for e in old]
    keep = [e for e in keep if e["files"]]
    path.write_text(json.dumps({"entries": [*keep, entry]}, indent=1, ensure_ascii=False) + "\n")
    return entry


def _covering(path: Path, root: Path):
    """The nearest directory with a ``record.json`` at or above ``path``'s, up to ``root``."""
    d = path.parent
    while not (d / RECORD).is_file():
        if d == root:
            return None
        d = d.parent
    return d


def record_problems(root: Path = RESULTS_ROOT, exists=None) -> list[str]:
    """What is wrong with the records under ``root``, one line each: every file must be named by
    exactly one entry of its nearest ``record.json``, every entry name existing files, a command
    (or why there is none) and a commit for which ``exists(commit)`` holds."""
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
    results brought back from a lent device or measured by hand, added to ``DIR/record.json``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks record", description=main.__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--command", required=True, help="the command that regenerates the files")
    ap.add_argument("--commit", default="HEAD", help="the commit they ran at (default: HEAD)")
    ap.add_argument("--how", default="added by hand (python -m benchmarks record)")
    a = ap.parse_args(argv)
    missing = [f for f in a.files if not (Path(a.dir) / f).is_file()]
    sha = _git("rev-parse", "--verify", "-q", f"{a.commit}^{{commit}}")
    if missing or not sha:
        why = f"no {', '.join(missing)} in {a.dir}" if missing else f"no commit {a.commit!r} in this repository"
        print(f"python -m benchmarks record: {why}", file=sys.stderr)
        return 2
    add_record(a.dir, a.files, a.command, how=a.how, commit=sha)
    return 0


commit_info()  # the commit this process starts at, whatever the tree holds when a run ends

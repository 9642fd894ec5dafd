"""A user's end-to-end check over the coverage's families: a ``save_pretrained`` checkpoint A
merged, by the command line's path, with a copy of it moved by a random element of its own report;
the merge, loaded back by transformers, must compute what A computes. One row per family the
coverage builds (:func:`.family.families`), each in a forked child under a timeout; the stages:

1. **build**: the tiny model (:func:`.shrink.build`) re-drawn in float64
   (``symgraph.testing.models.randomized``), saved, loaded back (``from_pretrained(dtype=float64)``)
   and saved again: that is A. An A that, loaded again, computes something else fails at
   ``reload``. A forward that fails in float64 is retried in float32, the bound ``TOL32``.
2. **moved**: ``report.random_transform(seed=1, orthogonal=True)`` of ``symgraph.analyze(A)``
   applied; the moved copy must compute A's kept outputs in memory and saved and loaded back (B),
   else the row is an *analysis bug*.
3. **merge**: ``symgraph.app.run.run_merge(build_config({"models": [A, B], "out": C}))``.
4. **load**: ``from_pretrained(C)``; the row's error is the largest relative deviation of its kept
   outputs from A's (:func:`symgraph.report.certify.deviation`), float64 throughout with the model's
   float32 casts kept wide, as the certificate runs (``error_as_run``: as the model runs). It
   passes at ≤ ``TOL`` (1e-6).

A row failing to build or run fails for transformers when the coverage says so
(:func:`.family.transformers_fails`), and so does an A that does not load or compute what it did.
Results: ``roundtrip.json`` and ``roundtrip.md`` in ``--out``, with their ``record.json`` entry.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings

from ..harness import script
from ..provenance import REPO_ROOT, cell, command_line, log, table, write_result
from .family import TASKS, TOL, _first_line, families, known, run_isolated, transformers_fails, where
from .summary import escape, git_info, head, parser

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage_roundtrip"
TOL32 = 1e-4   # the bound of a row retried in float32 (transformers cannot run it in float64)
VERDICTS = ("ok", "nothing to align", "merge differs", "analysis bug", "ours fails", "transformers fails", "timeout")
WARM = ("llama", "LlamaForCausalLM", None)

#: a copy of the parent's stderr, which the children (whose own goes to /dev/null) write progress to
PROGRESS = {"fd": None}


def _loaded(cls, path, dtype):
    return cls.from_pretrained(path, dtype=dtype).eval()


def _kept(model, report, inputs, wide=True):
    """The floating-point tensors of ``model``'s kept outputs on ``inputs``; ``wide``: a float64 model's
    own float32 casts kept wide (``symgraph.core.dtypes.wide_floats``), as the certificate runs it."""
    import contextlib

    import torch

    from symgraph.core.dtypes import wide_floats
    from symgraph.passes.trace import flatten_outputs, select_outputs
    args, kwargs = inputs
    wide = wide and next(model.parameters()).dtype == torch.float64
    with torch.no_grad(), wide_floats() if wide else contextlib.nullcontext():
        return flatten_outputs(select_outputs(model(*args, **kwargs), report.outputs))


class RoundTripError(Exception):
    """transformers' own round trip of A (``save_pretrained``, ``from_pretrained``) changes it."""


def _stages(rec, model_type, class_name, d, dtype, stage):
    """The stages of one row at ``dtype``; ``stage[0]`` names the one running."""
    import torch
    import transformers

    import symgraph
    from symgraph.app.config import build_config
    from symgraph.app.run import run_merge
    from symgraph.passes.inputs import default_inputs
    from symgraph.report.certify import deviation
    from symgraph.testing.models import randomized

    from .shrink import build
    tol = TOL if dtype == torch.float64 else TOL32
    rec.update(dtype=str(dtype).removeprefix("torch."), tol=tol)
    path = {k: os.path.join(d, k) for k in ("built", "a", "b", "c")}
    stage[0] = "build"
    model = randomized(build(model_type, class_name)[0], dtype=dtype)
    cls, inputs = getattr(transformers, class_name), default_inputs(model)
    stage[0] = "eager"
    with torch.no_grad():
        model(*inputs[0], **inputs[1])
    stage[0] = "save"
    model.save_pretrained(path["built"])
    stage[0] = "reload"  # A is what a user has: the checkpoint as the class loads and saves it
    a = _loaded(cls, path["built"], dtype)
    a.save_pretrained(path["a"])
    stage[0] = "analyze"
    t = time.perf_counter()
    report = symgraph.analyze(a)
    rec["analyze_seconds"] = time.perf_counter() - t
    want = _kept(a, report, inputs)
    rec["reload_error"] = deviation(_kept(model, report, inputs), want)
    stage[0] = "reload"
    again = deviation(want, _kept(_loaded(cls, path["a"], dtype), report, inputs))
    if not again <= tol:
        raise RoundTripError(f"A saved by save_pretrained and loaded again computes {again:.1e} off A")
    rec["groups"], rec["unread"] = len(report.groups), report.unread
    stage[0] = "moved"
    moved = symgraph.transform(a, report.random_transform(seed=1, orthogonal=True))
    rec["moved_weights"] = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), moved.parameters()))
    rec["moved_error"] = deviation(want, _kept(moved, report, inputs))
    stage[0] = "moved_saved"
    moved.save_pretrained(path["b"])
    rec["moved_saved_error"] = deviation(want, _kept(_loaded(cls, path["b"], dtype), report, inputs))
    stage[0] = "merge"
    t = time.perf_counter()
    nothing = {"align": "none"} if report.unread else {}  # refused otherwise: what a user is told to pass
    out = run_merge(build_config({"models": [path["a"], path["b"]], "out": path["c"], **nothing}), progress=False)
    rec.update(merge_seconds=time.perf_counter() - t, merge_mode=out.mode)
    stage[0] = "load"
    merged = _loaded(cls, path["c"], dtype)
    rec["merged_dtype"] = str(next(merged.parameters()).dtype).removeprefix("torch.")
    rec["error"] = deviation(want, _kept(merged, report, inputs))
    rec["error_as_run"] = deviation(_kept(a, report, inputs, wide=False), _kept(merged, report, inputs, wide=False))
    stage[0] = "done"


def verdict(rec) -> str:
    """``ok``; ``merge differs``; ``analysis bug`` (the moved copy, in memory or saved, computes something
    else); ``transformers fails`` (it cannot build, run or load its own checkpoint); else ``ours
    fails``; ``nothing to align``: a merge equal to A whose report fixes every parameter (one unread)."""
    tol, fail = rec.get("tol", TOL), rec.get("failure")
    if any(rec.get(k) is not None and not rec[k] <= tol for k in ("moved_error", "moved_saved_error")):
        return "analysis bug"
    if fail:
        if fail["stage"] == "timeout":
            return "timeout"
        return "transformers fails" if fail.get("transformers_fails") else "ours fails"
    if rec.get("error") is None or not rec["error"] <= tol:
        return "merge differs"
    return "nothing to align" if rec.get("unread") else "ok"


def run_row(model_type: str, class_name: str, task: str | None) -> dict:
    """One family's round trip; every failure is a row. ``task`` None: the parent's warm-up, build and
    analysis alone (a merge leaves threads, and a child forked from them can deadlock)."""
    import torch
    if task is None:
        import symgraph

        from .shrink import build
        return {"groups": len(symgraph.analyze(build(model_type, class_name)[0]).groups)}
    rec = {"model_type": model_type, "class": class_name, "task": task, "error": None, "failure": None}
    t0, stage = time.perf_counter(), ["build"]
    for dtype in (torch.float64, torch.float32):
        with tempfile.TemporaryDirectory(prefix="roundtrip-") as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                _stages(rec, model_type, class_name, d, dtype, stage)
                rec["failure"] = None
                break
            except Exception as e:  # noqa: BLE001 - every failure is a row
                rec["failure"] = {"stage": stage[0], "type": type(e).__name__, "message": _first_line(e),
                                  "where": where(e)}
                if dtype == torch.float64 and stage[0] == "eager":  # its forward refuses float64
                    rec["float64_failure"] = rec["failure"]
                    continue
                # transformers': building or running as the coverage judges it, saving or loading its own checkpoint
                rec["failure"]["transformers_fails"] = bool(transformers_fails(model_type, class_name, stage[0], e)) \
                    if stage[0] in ("build", "eager") else stage[0] in ("save", "reload")
                break
    rec.update(stage=stage[0], seconds=time.perf_counter() - t0)
    rec["verdict"] = verdict(rec)
    if PROGRESS["fd"] is not None:
        os.write(PROGRESS["fd"], (_progress(rec) + "\n").encode())
    return rec


def _progress(r) -> str:
    f = r.get("failure")
    return (f"{r['task']:<9} {r['model_type']:<26} {r['verdict']:<18} error {_num(r.get('error'))} "
            f"{r.get('seconds', 0):.0f}s " + (f"{f['stage']}: {f['type']}: {f['message'][:90]}" if f else ""))


def _num(v, fmt=".1e") -> str:
    return cell(v, fmt, "-")


def markdown(res) -> str:
    """The table of a run: totals by verdict, then one row per family."""
    h, rows = res["header"], res["rows"]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    lines = head("Round trip: a checkpoint merged with its moved copy, loaded back", h) + [
        f"- transformers {h['machine']['transformers']}, torch {h['machine']['torch']}, "
        f"{h['machine']['cores']} cores; {h['jobs']} family at a time, timeout {h['timeout_s']:.0f} s, "
        f"memory limit {h['mem_gb']} GB; wall {h['wall_seconds']:.0f} s",
        f"- families ({len(rows)}): " + (" ".join(h["only"]) if h["only"] else "every one of the tasks")
        + f"; tasks: {', '.join(h['tasks'])}",
        f"- bound: error ≤ {TOL:g} (float64); ≤ {TOL32:g} for a row transformers cannot run in float64 "
        "(retried in float32, its dtype column says so)", "",
        *table(VERDICTS, [[counts[v] for v in VERDICTS]]), "",
        "Columns: *moved by* is the largest change of a weight by the random element; *moved* the moved copy's "
        "deviation from A's kept outputs in memory, *saved* after saving and loading it; *error* the merge's, "
        "loaded back (float64 throughout; *as run*: with the model's own float32 casts). A failure names its "
        "stage.", ""]
    body = []
    for r in rows:
        f = r.get("failure") or {}
        fail = f"{f['stage']}: {f.get('type')}: {escape(f.get('message', ''))[:160]}" if f else "-"
        if r.get("float64_failure") and not f:
            fail = "float64 refused (" + escape(r["float64_failure"]["message"])[:100] + "): float32"
        body.append([r["model_type"], r["class"], r["task"], r["verdict"], r.get("dtype", "-"), r.get("groups", "-"),
                     _num(r.get("moved_weights"), ".2g"), _num(r.get("moved_error")), _num(r.get("moved_saved_error")),
                     _num(r.get("error")), _num(r.get("error_as_run")), r.get("merge_mode", "-"),
                     _num(r.get("merge_seconds"), ".1f"), _num(r.get("seconds"), ".1f"), fail])
    lines += table(["model_type", "class", "task", "verdict", "dtype", "groups", "moved by", "moved", "saved", "error",
                    "as run", "merge", "merge s", "row s", "failure"], body)
    return "\n".join(lines) + "\n"


def run(out=None, only=None, tasks=None, jobs=1, timeout=300.0, mem_gb=6.0, command=None) -> dict:
    """The round trip of the selected families; ``roundtrip.json`` / ``.md`` into ``out``."""
    from ..harness import machine_info
    t0, git = time.perf_counter(), git_info()
    fams = known(families(tasks, only), only)
    PROGRESS["fd"] = os.dup(2)
    try:
        rows = run_isolated(fams, jobs, timeout, mem_gb, run=run_row, warm=WARM)
    finally:
        os.close(PROGRESS["fd"])
        PROGRESS["fd"] = None
    for r in rows:
        if "verdict" not in r:  # a child that timed out or crashed
            r.update(failure=dict(r["error"], transformers_fails=False), error=None)
            r["verdict"] = verdict(r)
            log(_progress(r))
    res = {"header": {"command": command or "python -m benchmarks.coverage.roundtrip", "git": git,
                      "machine": machine_info(), "jobs": jobs, "timeout_s": timeout, "mem_gb": mem_gb,
                      "tolerance": TOL, "tolerance_float32": TOL32, "tasks": list(tasks or TASKS),
                      "only": only, "wall_seconds": time.perf_counter() - t0}, "rows": rows}
    if out:
        write_result(out, ".roundtrip-", res, markdown, json_name="roundtrip.json", md_name="roundtrip.md",
                     command=res["header"]["command"])
    return res


def main(argv=None) -> int:
    a = parser("python -m benchmarks.coverage.roundtrip", __doc__.splitlines()[0], DEFAULT_OUT, 1, 300.0)\
        .parse_args(argv)
    res = run(a.out, a.only, a.tasks, a.jobs, a.timeout, a.mem_gb or None,
              command_line(argv, "benchmarks.coverage.roundtrip"))
    counts = {v: sum(r["verdict"] == v for r in res["rows"]) for v in VERDICTS}
    print("  ".join(f"{v}: {n}" for v, n in counts.items()) + f"  -> {a.out}")
    return 0


if __name__ == "__main__":
    script(main)

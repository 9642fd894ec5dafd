"""One row of the coverage: a family's class built tiny, run, traced, analysed, certified and
checked complete; and the isolated run over many rows."""
from __future__ import annotations

import collections
import contextlib
import math
import os
import resource
import time
import warnings

from .at_default import where
from .shrink import build, tiny_config
from .structure import expectations

TASKS = {task: f"MODEL_FOR_{name}_MAPPING_NAMES" for task, name in (
    ("causal_lm", "CAUSAL_LM"), ("masked_lm", "MASKED_LM"), ("seq_cls", "SEQUENCE_CLASSIFICATION"),
    ("image_cls", "IMAGE_CLASSIFICATION"), ("seq2seq_lm", "SEQ_TO_SEQ_CAUSAL_LM"), ("ctc", "CTC"),
    ("speech_seq2seq", "SPEECH_SEQ_2_SEQ"), ("audio_cls", "AUDIO_CLASSIFICATION"),
    ("image_text_to_text", "IMAGE_TEXT_TO_TEXT"), ("object_detection", "OBJECT_DETECTION"),
    ("semantic_segmentation", "SEMANTIC_SEGMENTATION"))}
TOL = 1e-6
TARGET_COMPLETE = 0.95      # of the causal-LM families that trace
TARGET_RUNS = 0.97          # sound and complete, of what transformers builds and runs
TARGET_MEDIAN_S = 5.0       # median analysis seconds per family, 2 cores


def row(model_type, class_name, task, stage="config", error=None) -> dict:
    """A row before (or without) any result."""
    return {"model_type": model_type, "class": class_name, "task": task, "stage": stage, "traced": False,
            "sound": None, "complete": None, "certificate": None, "error": error}


def _first_line(e: BaseException) -> str:
    """The exception's first line (with the next one when the first only introduces it)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first += " " + lines[1]
    return first[:300]


def failed(rec, e: BaseException) -> None:
    """``rec``'s error: its stage, the exception's type, first line and where it was raised."""
    if isinstance(e, KeyboardInterrupt):
        raise e
    rec["error"] = {"stage": rec["stage"], "type": type(e).__name__, "message": _first_line(e), "where": where(e)}


@contextlib.contextmanager
def _one_trace():
    """Trace once per model and inputs (``analyze``, ``unruled_ops`` and the check share it); yields the tracer."""
    import symgraph.passes.trace as tr
    import symgraph.report.api as api
    orig, cache = tr.trace, {}

    def cached(model, inputs=None):
        key = (id(model), id(inputs))
        if key not in cache:
            cache[key] = (model, orig(model, inputs))
        return cache[key][1]
    patched = [mod for mod in (tr, api) if getattr(mod, "trace", None) is orig]
    for mod in patched:
        mod.trace = cached
    try:
        yield cached
    finally:
        for mod in patched:
            mod.trace = orig


def analyse(rec, model, inputs, check):
    """``symgraph.analyze(model, inputs)`` (timed) into ``rec``: its classes, the ops without a rule,
    ``check(exported program, report)``'s structure (complete: nothing ``missing``) and its blockers."""
    import symgraph
    from symgraph.cli.coverage import unruled_ops
    with _one_trace() as traced:
        t = time.perf_counter()
        report = symgraph.analyze(model, inputs)
        rec.update(analyze_seconds=time.perf_counter() - t, traced=True, groups=len(report.groups),
                   group_kinds=dict(sorted(collections.Counter(g.kind for g in report.groups).items())),
                   frozen=sorted({(str(f.op), f.module) for f in report.frozen}), stage="unruled_ops")
        t = time.perf_counter()
        rec["unruled_ops"] = dict(sorted(unruled_ops(model, inputs).items()))
        rec.update(unruled_seconds=time.perf_counter() - t, stage="structure")
        rec["structure"] = check(traced(model, inputs)[0], report)
        rec["complete"] = not rec["structure"]["missing"]
        rec["blockers"] = blockers(rec)
    return report


def certify(rec, report, model, inputs, tol32: float) -> None:
    """``report.certify`` at an infinite tolerance into ``rec``: sound at ≤ :data:`TOL`, or ``tol32``
    where the model cannot run in float64."""
    rec["stage"] = "certify"
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worst = report.certify(model, inputs, tol=math.inf)
    f32 = any("float32" in str(w.message) for w in caught)
    rec.update(certify_seconds=time.perf_counter() - t, certificate=worst,
               certificate_dtype="float32" if f32 else "float64", sound=bool(worst <= (tol32 if f32 else TOL)),
               stage="done")


def run_family(model_type: str, class_name: str, task: str) -> dict:
    """One row (the package docstring's stages); a failure is recorded with its stage."""
    import symgraph
    from symgraph.passes.inputs import default_inputs
    from symgraph.report.certify import FLOAT32_TOL
    rec = row(model_type, class_name, task)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec["overrides"] = tiny_config(model_type)[1]
            rec["stage"] = "build"
            import transformers
            if not hasattr(transformers, class_name):
                raise ImportError(f"transformers has no class {class_name}")
            model, _ = build(model_type, class_name)
            rec["parameters"] = sum(p.numel() for p in model.parameters())
            rec["stage"] = "inputs"
            args, kwargs = default_inputs(model)
            rec["stage"] = "eager"
            run_eagerly(model, args, kwargs)
            rec["stage"] = "trace"
            tied = symgraph.tied_parameters(model)
            report = analyse(rec, model, None, lambda ep, r: expectations(ep, r, model.config, tied))
            certify(rec, report, model, None, max(TOL, FLOAT32_TOL))
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        failed(rec, e)
        if rec["stage"] in ("config", "build", "eager"):
            rec["error"]["transformers_fails"] = transformers_fails(model_type, class_name, rec["stage"], e)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def transformers_fails(model_type: str, class_name: str, stage: str, e: BaseException):
    """Whether a row failing before the trace fails for transformers itself (out of the
    denominator): its own default config fails to validate, or the class to be constructed on it,
    with the same exception type; an eager failure, when the class on that config fails its forward
    with the same type at the same line (:func:`.at_default.fails_eager_at_default`). A failure
    transformers raises on purpose (:func:`.at_default.refusal`) is never cleared: our inputs may
    be what it refuses."""
    from . import at_default
    if stage == "eager":
        return not at_default.refusal(e) and at_default.fails_eager_at_default(model_type, class_name) == \
            f"{type(e).__name__} at {at_default.model_line(e)}"
    found = at_default.fails_at_default(model_type, class_name)
    return bool(found) and found.split(":")[0] == type(e).__name__


def run_eagerly(model, args, kwargs) -> None:
    """The model's own forward on its example inputs, as transformers runs it (no trace)."""
    import torch
    with torch.no_grad():
        model(*args, **kwargs)


def blockers(r) -> list:
    """Each missing class kind of a traced row with the frozen ops in its module (and its why)."""
    out = []
    for m in r["structure"]["missing"]:
        mod = m["module"]
        ops = sorted({op for op, fm in r.get("frozen", ())
                      if not mod or fm and (fm.startswith(mod) or mod.startswith(fm + "."))})
        out.append({"kind": m["kind"], "module": mod, "frozen_ops": ops, **({"why": m["why"]} if "why" in m else {})})
    return out


# --- isolation and the run ----------------------------------------------------------------------


def families(tasks=None, only=None) -> list:
    """``[(model_type, class, task)]`` of the auto mappings, in task then model-type order;
    ``only`` keeps the rows whose model type or class is listed."""
    from transformers.models.auto import modeling_auto
    out = []
    for task in tasks or TASKS:
        for mt, cls in getattr(modeling_auto, TASKS[task]).items():
            cls = cls[0] if isinstance(cls, (list, tuple)) else cls
            if not only or mt in only or cls in only:
                out.append((mt, cls, task))
    return out


def known(fams, only) -> list:
    """``fams``, after exiting with the names of ``only`` that none of them has."""
    unknown = sorted(set(only or ()) - {f[0] for f in fams} - {f[1] for f in fams})
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(unknown)}")
    return fams


def _child(conn, fam, mem_gb, threads, run):
    try:
        with contextlib.suppress(OSError, AttributeError):  # Linux: SIGKILL when the parent dies
            import ctypes
            import signal
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        devnull = os.open(os.devnull, os.O_WRONLY)  # the children's warnings would bury the log
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        if mem_gb:
            lim = int(mem_gb * 2 ** 30)
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        import torch
        torch.set_num_threads(threads)
        conn.send(run(*fam))
    except BaseException as e:  # noqa: BLE001
        with contextlib.suppress(BaseException):
            conn.send(row(*fam, "child", {"stage": "child", "type": type(e).__name__, "message": _first_line(e)}))
    finally:
        conn.close()
        os._exit(0)


def run_isolated(fams, jobs: int = 2, timeout: float = 120.0, mem_gb: float | None = 6.0,
                 log=None, run=run_family, warm=("llama", "LlamaForCausalLM", "causal_lm"), stop=None) -> list:
    """Each family's ``run(*family)`` in a forked child (``jobs`` at a time) under ``RLIMIT_AS`` and
    a timeout; the rows in the order of ``fams``. ``warm``: run once in the parent first (the caches
    every child inherits); ``stop()``: true when no further family may start (its row stays None)."""
    import multiprocessing as mp

    import symgraph  # noqa: F401 - imported once here, inherited by every forked child
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # warm the export's caches in one thread (no thread pool is forked)
    with contextlib.redirect_stderr(None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(*warm)
    ctx = mp.get_context("fork")
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    pending = list(enumerate(fams))
    running = {}   # index -> (process, conn, start)
    rows = [None] * len(fams)
    while pending or running:
        if stop is not None and stop():
            pending = []
        while pending and len(running) < jobs:
            i, fam = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(send, fam, mem_gb, threads, run), daemon=True)
            p.start()
            send.close()
            running[i] = (p, recv, time.perf_counter())
        time.sleep(0.05)
        for i, (p, conn, start) in list(running.items()):
            fam, got = fams[i], None
            if conn.poll():
                with contextlib.suppress(EOFError):
                    got = conn.recv()
                if got is not None:
                    p.join(10)
            elif not p.is_alive():
                p.join()
                got = row(*fam, "crashed", {"stage": "crashed", "type": "Crashed", "message": (
                    f"child exited with code {p.exitcode}" + (" (killed: out of memory?)" if p.exitcode in (-9, 137)
                                                               else ""))})
            elif time.perf_counter() - start > timeout:
                p.kill()
                p.join()
                got = row(*fam, "timeout", {"stage": "timeout", "type": "Timeout",
                                             "message": f"no result in {timeout:.0f} s"})
            if got is None:
                continue
            if p.is_alive():
                p.kill()
                p.join()
            got["wall_seconds"] = time.perf_counter() - start
            rows[i] = got
            conn.close()
            del running[i]
            if log:
                log(_line(got, sum(r is not None for r in rows), len(fams)))
    return rows


def _line(r, k, n) -> str:
    if r.get("error"):
        e = r["error"]
        state = f"FAIL {e['stage']}: {e['type']}: {e['message'][:100]}"
    else:
        miss = ",".join(sorted({m["kind"] for m in r["structure"]["missing"]})) or "-"
        state = (f"cert {r['certificate']:.1e} {'sound' if r['sound'] else 'UNSOUND'} "
                 f"{'complete' if r['complete'] else 'missing ' + miss} "
                 f"unruled {len(r['unruled_ops'])} {r['analyze_seconds']:.1f}s")
    return f"[{k}/{n}] {r['task']:<9} {r['model_type']:<28} {state}"

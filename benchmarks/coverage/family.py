"""One family traced, analysed, certified and checked; and the isolated run over many."""
from __future__ import annotations


import collections
import contextlib
import math
import os
import resource
import time
import warnings


from .at_default import where
from .constants import TASKS, TOL
from .shrink import build, tiny_config
from .structure import expectations


# --- one family -------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    """The exception's first line (with the next one when the first only introduces it)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first += " " + lines[1]
    return first[:300]


@contextlib.contextmanager
def _one_trace():
    """Trace once per model: ``analyze``, ``unruled_ops`` and :func:`expectations` share the
    exported program (each would otherwise re-export the same model on the same inputs)."""
    import symgraph.passes.trace as tr
    import symgraph.report.api as api
    orig, cache = tr.trace, {}

    def cached(model, inputs=None):
        key = (id(model), id(inputs))
        if key not in cache:
            cache[key] = (model, orig(model, inputs))
        return cache[key][1]
    patched = [(mod, "trace") for mod in (tr, api) if getattr(mod, "trace", None) is orig]
    for mod, name in patched:
        setattr(mod, name, cached)
    try:
        yield lambda model: cached(model)
    finally:
        for mod, name in patched:
            setattr(mod, name, orig)


def run_family(model_type: str, class_name: str, task: str) -> dict:
    """One row: build, analyse, certify, check completeness and rule coverage of one class.
    Exceptions are caught per stage and recorded; the row says how far it got."""
    import symgraph
    from symgraph.cli.coverage import unruled_ops
    from symgraph.passes.inputs import default_inputs
    from symgraph.report.certify import FLOAT32_TOL
    rec = {"model_type": model_type, "class": class_name, "task": task, "stage": "config",
           "traced": False, "sound": None, "complete": None, "certificate": None, "error": None}
    t0 = time.perf_counter()
    stage = "config"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg, overrides = tiny_config(model_type)
            rec["overrides"] = overrides
            stage = "build"
            import transformers
            if not hasattr(transformers, class_name):
                raise ImportError(f"transformers has no class {class_name}")
            model, _ = build(model_type, class_name)
            rec["parameters"] = sum(p.numel() for p in model.parameters())
            cfg = model.config
            stage = "inputs"
            args, kwargs = default_inputs(model)
            stage = "eager"
            run_eagerly(model, args, kwargs)
            stage = "trace"
            with _one_trace() as traced:
                t = time.perf_counter()
                report = symgraph.analyze(model)
                rec["analyze_seconds"] = time.perf_counter() - t
                rec["traced"] = True
                rec["groups"] = len(report.groups)
                rec["group_kinds"] = dict(sorted(collections.Counter(g.kind for g in report.groups).items()))
                rec["frozen"] = sorted({(str(f.op), f.module) for f in report.frozen})
                stage = "unruled_ops"
                t = time.perf_counter()
                rec["unruled_ops"] = dict(sorted(unruled_ops(model).items()))
                rec["unruled_seconds"] = time.perf_counter() - t
                stage = "structure"
                ep = traced(model)[0]
                rec["structure"] = expectations(ep, report, cfg, symgraph.tied_parameters(model))
                rec["complete"] = not rec["structure"]["missing"]
                rec["blockers"] = blockers(rec)
            stage = "certify"
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                worst = report.certify(model, tol=math.inf)
            f32 = any("float32" in str(w.message) for w in caught)
            rec["certify_seconds"] = time.perf_counter() - t
            rec["certificate"] = worst
            rec["certificate_dtype"] = "float32" if f32 else "float64"
            rec["sound"] = bool(worst <= (max(TOL, FLOAT32_TOL) if f32 else TOL))
            stage = "done"
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        if isinstance(e, KeyboardInterrupt):
            raise
        rec["error"] = {"stage": stage, "type": type(e).__name__, "message": _first_line(e),
                        "where": where(e)}
        if stage in ("config", "build", "eager"):
            rec["error"]["transformers_fails"] = transformers_fails(model_type, class_name, stage, e)
    rec["stage"] = stage
    rec["seconds"] = time.perf_counter() - t0
    return rec


def transformers_fails(model_type: str, class_name: str, stage: str, e: BaseException):
    """Whether a row that fails before the trace fails for transformers itself (out of the
    denominator), by the cheapest sound test: its own default config of the family fails to
    validate, or the class fails to be constructed on it (meta device), with the same exception
    type; an eager failure, when the class on that default config fails its forward with the
    same type at the same line of transformers (:func:`.at_default.fails_eager_at_default`:
    for real, or under fake tensors when the default model is too large to run here). A
    failure at the shrunk size alone is the shrink rule's. This clears the shrink rule, not our
    example inputs: an input the forward refuses at every size fails at the default too
    (LW-DETR's 224-pixel images did, before they took its backbone's size; Gemma 4's
    assistant's missing states did), so a failure transformers raises on purpose
    (:func:`.at_default.refusal`) is never cleared, and a cleared row names its exception."""
    from .at_default import fails_eager_at_default, model_line, refusal
    from .shrink import fails_at_default
    if stage == "eager":
        return not refusal(e) and fails_eager_at_default(model_type, class_name) == \
            f"{type(e).__name__} at {model_line(e)}"
    at_default = fails_at_default(model_type, class_name)
    return bool(at_default) and at_default.split(":")[0] == type(e).__name__


def run_eagerly(model, args, kwargs) -> None:
    """The model's own forward on its example inputs, as transformers runs it (no trace): a
    row whose forward fails here is one transformers cannot run at the shrunk size."""
    import torch
    with torch.no_grad():
        model(*args, **kwargs)


# --- isolation and the run ----------------------------------------------------------------------


def families(tasks=None, only=None) -> list:
    """``[(model_type, class, task)]`` of the auto mappings, in task then model-type order;
    ``only`` keeps the rows whose model type or class is listed."""
    from transformers.models.auto import modeling_auto
    out = []
    for task in tasks or TASKS:
        for mt, cls in getattr(modeling_auto, TASKS[task]).items():
            if isinstance(cls, (list, tuple)):
                cls = cls[0]
            if only and mt not in only and cls not in only:
                continue
            out.append((mt, cls, task))
    return out


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the parent dies (no orphaned families)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(conn, fam, mem_gb, threads, run=None):
    try:
        _die_with_parent()
        devnull = os.open(os.devnull, os.O_WRONLY)  # the children's warnings would bury the log
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        if mem_gb:
            lim = int(mem_gb * 2 ** 30)
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        import torch
        torch.set_num_threads(threads)
        conn.send((run or run_family)(*fam))
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send({"model_type": fam[0], "class": fam[1], "task": fam[2], "stage": "child",
                       "traced": False, "sound": None, "complete": None, "certificate": None,
                       "error": {"stage": "child", "type": type(e).__name__, "message": _first_line(e)}})
        except BaseException:  # noqa: BLE001
            pass
    finally:
        conn.close()
        os._exit(0)


def run_isolated(fams, jobs: int = 2, timeout: float = 120.0, mem_gb: float | None = 6.0,
                 log=None, run=None, warm=("llama", "LlamaForCausalLM", "causal_lm"),
                 stop=None) -> list:
    """Run each family in a forked child (``jobs`` at a time), under a memory limit and a
    timeout; returns the rows in the order of ``fams``. ``run``: the function of one row
    (default :func:`run_family`), called with a family's fields; ``warm``: the fields of the
    row run once in the parent first (the caches every child inherits); ``stop()``: true when no
    further family may start (its row stays None)."""
    run = run or run_family
    import multiprocessing as mp

    import symgraph  # noqa: F401 - imported once here, inherited by every forked child
    import torch  # noqa: F401
    import transformers
    transformers.logging.set_verbosity_error()
    # warm torch.export's and the dispatcher's caches once, in one thread (no thread pool is
    # forked): each child would otherwise pay the first export (seconds) again
    torch.set_num_threads(1)
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
        for i in list(running):
            p, conn, start = running[i]
            fam = fams[i]
            row = None
            if conn.poll():
                try:
                    row = conn.recv()
                except EOFError:
                    row = None
                if row is not None:
                    p.join(10)
            elif not p.is_alive():
                p.join()
                row = _failed(fam, "crashed", f"child exited with code {p.exitcode}"
                              + (" (killed: out of memory?)" if p.exitcode in (-9, 137) else ""))
            elif time.perf_counter() - start > timeout:
                p.kill()
                p.join()
                row = _failed(fam, "timeout", f"no result in {timeout:.0f} s")
            if row is None:
                continue
            if p.is_alive():
                p.kill()
                p.join()
            row["wall_seconds"] = time.perf_counter() - start
            rows[i] = row
            conn.close()
            del running[i]
            if log:
                log(_line(row, sum(r is not None for r in rows), len(fams)))
    return rows


def _failed(fam, kind, msg) -> dict:
    return {"model_type": fam[0], "class": fam[1], "task": fam[2], "stage": kind, "traced": False,
            "sound": None, "complete": None, "certificate": None,
            "error": {"stage": kind, "type": kind.capitalize(), "message": msg}}


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


def blockers(r) -> list:
    """Why a traced row is incomplete: each missing class kind with the ops without a rule
    (or frozen ops) in its module, else the kind alone."""
    out = []
    for m in r["structure"]["missing"]:
        mod = m["module"]
        ops = sorted({op for op, fm in r.get("frozen", ())
                      if not mod or fm and (fm.startswith(mod) or mod.startswith(fm + "."))})
        out.append({"kind": m["kind"], "module": mod, "frozen_ops": ops,
                    **({"why": m["why"]} if "why" in m else {})})
    return out

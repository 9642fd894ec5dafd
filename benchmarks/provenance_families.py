"""The provenance benchmark's copies section: per tested family (:mod:`benchmarks.families`), a
tiny model A and B = A moved by a random element of the full groups (``report.random_transform``),
both saved with ``save_pretrained`` and compared as ``symgraph compare A B`` does
(:func:`symgraph.cli.compare.compare_paths`), in memory, then ``--out-of-core``. Target: every copy
"same", and the recovered element applied to B giving A within :data:`TARGET`. A family that fails
is a row with its reason."""
from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path

import torch

import symgraph
from symgraph.cli.compare import compare_paths

from .families import FAMILIES, build
from .provenance import cell, table

TARGET = 1e-6  # the largest relative error of A against B with the recovered element applied


def max_rel_error(want: dict, got: dict) -> float:
    """The largest ``‖got − want‖ / ‖want‖`` over ``want``'s floating-point tensors (float64)."""
    out = 0.0
    for k, w in want.items():
        if w.is_floating_point():
            w, g = w.detach().double(), got[k].detach().double()
            out = max(out, float((g - w).norm()) / max(float(w.norm()), 1e-300))
    return out


def _classes(res) -> int:
    rep = res.alignment.report_a
    return len(rep.groups) if rep is not None else 0


def family_row(name: str, seed: int = 0, out_of_core: bool = True) -> dict:
    """One family's row: in memory ``verdict`` and ``error`` (:func:`max_rel_error` of A against
    ``alignment.apply(B)``); out of core ``ooc_verdict``, ``ooc_error`` (the largest relative
    distance of B read into A's basis) and ``ooc_mode``; ``moved`` (B against A before alignment),
    ``kinds`` (group kinds filled), ``ok`` (all "same" within :data:`TARGET`), ``reason``."""
    t0 = time.perf_counter()
    row: dict = {"family": name, "ok": False, "reason": None}
    try:
        A = build(name)
        B = symgraph.transform(A, symgraph.analyze(A).random_transform(seed=seed))
        row["moved"] = max_rel_error(A.state_dict(), B.state_dict())
        with tempfile.TemporaryDirectory(prefix="provenance-") as d:
            a, b = str(Path(d) / "a"), str(Path(d) / "b")
            A.save_pretrained(a)
            B.save_pretrained(b)
            res = compare_paths(a, b, out_of_core=False)
            row.update(verdict=res.verdict, mode=res.mode, max_rel_distance=res.max_rel_distance,
                       kinds=res.group_kinds(), classes=_classes(res),
                       error=max_rel_error(A.state_dict(), res.alignment.apply(B).state_dict()))
            row["seconds_in_memory"] = time.perf_counter() - t0
            if out_of_core:
                t1 = time.perf_counter()
                ooc = compare_paths(a, b, out_of_core=True)
                row.update(ooc_verdict=ooc.verdict, ooc_mode=ooc.mode, ooc_classes=_classes(ooc),
                           ooc_error=max((t["rel_distance"] for t in ooc.tensors), default=0.0),
                           seconds_out_of_core=time.perf_counter() - t1)
        ways = ["", "ooc_"] if out_of_core else [""]
        verdicts, errors = [row[w + "verdict"] for w in ways], [row[w + "error"] for w in ways]
        row["ok"] = all(v == "same" for v in verdicts) and all(e <= TARGET for e in errors)
        if not row["ok"]:
            row["reason"] = f"verdicts {verdicts}, errors {', '.join(f'{e:.2e}' for e in errors)}"
            if out_of_core and row["ooc_classes"] != row["classes"]:
                row["reason"] += (f"; the out-of-core analysis (of the model built on the meta device) finds "
                                  f"{row['ooc_classes']} classes where the loaded model's finds {row['classes']}")
    except Exception as e:  # noqa: BLE001 - a family that fails is a row with its reason
        row["reason"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        row["traceback"] = traceback.format_exc(limit=4)[-1500:]
    row["seconds"] = time.perf_counter() - t0
    return row


def run_families(names=None, seed: int = 0, out_of_core: bool = True) -> dict:
    """:func:`family_row` of each family (default: all 22), printed as it comes, and the counts."""
    t0 = time.perf_counter()
    rows = []
    for name in names or FAMILIES:
        rows.append(family_row(name, seed, out_of_core))
        print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "traceback"},
              flush=True)
    mem = [r for r in rows if r.get("verdict") == "same" and r["error"] <= TARGET]
    ooc = [r for r in rows if r.get("ooc_verdict") == "same" and r["ooc_error"] <= TARGET]
    return {"rows": rows, "target": TARGET, "seed": seed, "out_of_core": out_of_core, "families": len(rows),
            "passed": sum(r["ok"] for r in rows), "same_in_memory": len(mem),
            "max_error_in_memory": max((r["error"] for r in mem), default=None),
            "same_out_of_core": len(ooc), "max_error_out_of_core": max((r["ooc_error"] for r in ooc), default=None),
            "loaded_instead": [r["family"] for r in rows if r.get("ooc_mode") == "in memory"],
            "seconds": time.perf_counter() - t0, "torch": torch.__version__}


def families_markdown(f: dict) -> str:
    """The section of ``report.md``: one row per family."""
    ooc = f["out_of_core"]
    lines = [f"## Transformed copies of the {f['families']} tested families", "",
             "Each family's tiny model A (`benchmarks/families.py`, the families "
             "`tests/test_families_full_groups.py` recovers) and B = A moved by a random element of the full "
             f"groups (`random_transform(seed={f['seed']})`), saved and compared as `symgraph compare A B` "
             "compares them: in memory" + (", then `--out-of-core`" if ooc else "") + ". Error: the largest "
             "relative Frobenius distance over A's tensors between A and the recovered element applied to B "
             "(`alignment.apply(B)`; out of core: B read into A's basis tensor by tensor). Moved: B against A "
             "before alignment.", "",
             f"**In memory (what `symgraph compare` runs for models this small): {f['same_in_memory']}/"
             f"{f['families']} families 'same' within {f['target']:.0e}** (largest error "
             f"{cell(f['max_error_in_memory'], '.1e')})." + (
                 f" Out of core: {f['same_out_of_core']}/{f['families']} (largest error of those "
                 f"{cell(f['max_error_out_of_core'], '.1e')}; {len(f['loaded_instead'])} loaded in memory "
                 "instead, marked: transformers renames their stored tensors on load)." if ooc else "")
             + f" All rows ok: {f['passed']}/{f['families']}; {f['seconds']:.0f} s.", ""]
    rows = []
    for r in f["rows"]:
        cells = [r["family"], r.get("verdict", "error"), cell(r.get("error"), ".1e"), cell(r.get("moved"), ".1e")]
        if ooc:
            mode = r.get("ooc_mode")
            cells += [r.get("ooc_verdict", "—") + ("" if mode in (None, "out of core") else f" ({mode})"),
                      cell(r.get("ooc_error"), ".1e")]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted((r.get("kinds") or {}).items()))
        rows.append(cells + [kinds or "—", f"{r['seconds']:.1f}"])
    ooc_head = ["out of core: verdict", "error"] if ooc else []
    lines += table(["family", "verdict", "error", "moved", *ooc_head, "group kinds filled", "seconds"], rows)
    failed = [r for r in f["rows"] if not r["ok"]]
    if failed:
        lines += ["", "Failed:"] + [f"- {r['family']}: {r['reason']}" for r in failed]
    return "\n".join(lines + [""])

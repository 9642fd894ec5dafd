"""Coverage of diffusers models: the tiny UNet, DiT, SD3 MMDiT, Flux and VAE of
``symgraph.testing.diffusion`` traced, analysed, certified (float64) and a randomly transformed
copy recovered by weight matching; one row per model.

``python -m benchmarks coverage_diffusers [--models NAME ...] [--out DIR]``: writes
``coverage.json`` and ``coverage.md`` into ``DIR`` and their entry in its ``record.json``.

Columns: traced (exported and analysed), sound (certificate ≤ 1e-6), complete (no frozen op, and
every class the graph's structure calls for found: the vision table's rule,
:func:`benchmarks.coverage.vision.completeness`), missing (those not found), frozen ops, fixed
parameters (no group on any dimension; folded norm gains aside), the certificate, the recovery
error (largest weight difference after aligning the transformed copy back), and the analysis and
alignment times. The markdown lists each fixed parameter with the reason the analysis records
(Flux's query/key RMSNorm gains, before a rotation by a distinct angle per pair, are fixed by
the function itself)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .harness import script
from .provenance import cell, commit_info, command_line, log, table, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "coverage_diffusers"
TOL = 1e-6
OUTPUT = "read by the output (fixed, with no other reason)"


def _why(report, name) -> str:
    """The last reason that fixed ``name``'s first dimension's innermost class."""
    reasons = report.axis_reasons(name, 0)[-1]["reasons"]
    return reasons[-1][1] if reasons else OUTPUT


def row(name: str) -> dict:
    """One model: analysed, certified, recovered; failures recorded with their stage."""
    import symgraph
    import symgraph.passes.trace as tr
    from symgraph.testing.diffusion import build, fixed_params

    from .coverage.vision import completeness
    rec = {"model": name, "traced": False, "sound": None, "complete": None, "error": None}
    stage = "build"
    try:
        m, x = build(name)
        rec.update({"class": type(m).__name__, "parameters": sum(p.numel() for p in m.parameters())})
        stage = "analyze"
        t = time.perf_counter()
        r = symgraph.analyze(m, x)
        rec["analyze_seconds"] = time.perf_counter() - t
        rec["traced"] = True
        fixed = fixed_params(m, r)
        rec.update({"groups": len(r.groups), "frozen_ops": sorted({str(f.op) for f in r.frozen}),
                    "fixed_buffers": r.fixed_buffers, "moved_buffers": r.buffers,
                    "fixed_params": {n: _why(r, n) for n in fixed}})
        rec["missing"] = completeness(tr.trace(m, x)[0], r)["missing"]
        rec["complete"] = not r.frozen and not rec["missing"]
        stage = "certify"
        rec["certificate"] = r.certify(m, x, tol=float("inf"))
        rec["sound"] = rec["certificate"] <= TOL
        stage = "align"
        moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
        t = time.perf_counter()
        got = symgraph.align(m, moved, x).apply(moved).state_dict()
        rec["align_seconds"] = time.perf_counter() - t
        want, was = m.state_dict(), moved.state_dict()
        rec["moved"] = max((was[k] - want[k]).abs().max().item() for k in want)
        rec["recovery_error"] = max((got[k] - want[k]).abs().max().item() for k in want)
        stage = "done"
    except Exception as e:  # noqa: BLE001 - every failure is a row
        rec["error"] = {"stage": stage, "type": type(e).__name__, "message": str(e).splitlines()[0][:300]}
    return rec


def markdown(res) -> str:
    rows = [(r["model"], r.get("class", "-"), r.get("parameters", "-"), r["traced"], r["sound"], r["complete"],
             len(r.get("missing", [])), len(r.get("frozen_ops", [])), len(r.get("fixed_params", {})),
             r.get("groups", "-"), cell(r.get("certificate"), ".1e", "-"), cell(r.get("recovery_error"), ".1e", "-"),
             cell(r.get("analyze_seconds"), ".2f", "-"), cell(r.get("align_seconds"), ".2f", "-")) for r in res["rows"]]
    lines = ["# Coverage of diffusers models", "",
             f"- command: `{res['command']}`", f"- commit: `{res['commit']}`" + (" (dirty)" if res["dirty"] else ""),
             f"- diffusers {res['diffusers']}, torch {res['torch']}; tiny models from configs, float64, "
             f"weights N(0, 0.3²) (symgraph.testing.diffusion); sound: certificate ≤ {TOL:g}", "",
             *table(["model", "class", "params", "traced", "sound", "complete", "missing", "frozen ops",
                     "fixed params", "groups", "certificate", "recovery error", "analysis s", "align s"], rows,
                    ["l", "l", "r", "c", "c", "c", "r", "r", "r", "r", "r", "r", "r", "r"]), "",
             "## Fixed parameters and why", ""]
    for r in res["rows"]:
        for miss in r.get("missing", []):
            lines.append(f"- {r['model']}: missing {miss['kind']} of `{miss.get('module', '')}`: "
                         f"{miss.get('why', '')}")
        for n, why in r.get("fixed_params", {}).items():
            lines.append(f"- {r['model']}: `{n}`: {why}")
        if r.get("error"):
            lines.append(f"- {r['model']}: failed at {r['error']['stage']}: {r['error']['message']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from symgraph.testing.diffusion import BUILDERS
    ap = argparse.ArgumentParser(prog="python -m benchmarks coverage_diffusers", description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=tuple(BUILDERS), default=list(BUILDERS))
    ap.add_argument("--out", default=str(RESULTS), help="directory for coverage.json / coverage.md")
    a = ap.parse_args(argv)
    import diffusers
    import torch
    rows = []
    for name in a.models:
        log(f"coverage_diffusers: {name}")
        rows.append(row(name))
    info = commit_info()
    res = {"command": command_line(argv, "benchmarks coverage_diffusers"), "commit": info["commit"],
           "dirty": info["dirty"], "diffusers": diffusers.__version__, "torch": torch.__version__, "tolerance": TOL,
           "rows": rows}
    print(markdown(res))
    write_result(a.out, ".coverage-diffusers-", res, markdown, json_name="coverage.json", md_name="coverage.md",
                 command=res["command"])
    return 0 if all(r["sound"] for r in rows) else 1


if __name__ == "__main__":
    script(main)

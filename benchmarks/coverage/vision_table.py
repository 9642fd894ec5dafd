"""The vision coverage table (:mod:`.vision`): totals per zoo over what the zoo builds and runs,
what blocks each missing class, the ops without a rule, and one line per family."""
from __future__ import annotations

import collections

from ..provenance import table
from .constants import TOL
from .summary import _cell, _counts, _whys

ZOOS = ("timm", "torchvision")
TARGET = 0.90


def summarize(rows) -> dict:
    """Per zoo and overall: :func:`~.summary._counts` (``runs``: what the zoo builds and runs),
    the target over it, the missing kinds with what blocks them, the ops without a rule. Rows
    of families never started (the run's ``--budget`` spent) count nowhere but ``not_run``."""
    not_run = [f"{r['task']}/{r['model_type']}" for r in rows if r["stage"] == "not_run"]
    rows = [r for r in rows if r["stage"] != "not_run"]
    by = {z: _counts([r for r in rows if r["task"] == z]) for z in ZOOS if any(r["task"] == z for r in rows)}
    by["all"] = _counts(rows)
    for b in by.values():
        b["meets_target"] = bool(b["runs"]) and b["sound_and_complete"] / b["runs"] >= TARGET
    blocked = collections.defaultdict(lambda: collections.defaultdict(list))
    unruled = collections.defaultdict(list)
    for r in rows:
        for k, why in _whys(r):
            blocked[k][why].append(f"{r['task']}/{r['model_type']}")
        for op in r.get("unruled_ops") or {}:
            unruled[op].append(f"{r['task']}/{r['model_type']}")
    return {"by_zoo": by, "target": TARGET, "unsound": sum(r["sound"] is False for r in rows),
            "blocked_by": {k: dict(v) for k, v in blocked.items()},
            "unruled_ops": dict(sorted(unruled.items(), key=lambda kv: -len(kv[1]))), "not_run": not_run}


def markdown(res) -> str:
    h, s = res["header"], res["summary"]
    lines = ["# Coverage of the vision zoos (timm, torchvision)", "",
             f"- command: `{h['command']}`", f"- commit: `{h['git']['commit']}`"
             + (" (dirty working tree)" if h["git"].get("dirty") else ""),
             f"- {', '.join(f'{k} {v}' for k, v in h['versions'].items())}; {h['jobs']} families at a "
             f"time, timeout {h['timeout_s']:.0f} s, memory limit {h['mem_gb']} GB; wall {h['wall_seconds']:.0f} s",
             "- one row per family (a module of the zoo), its smallest variant by parameter count, random "
             "weights; complete: every channel class, MLP and attention head a vision model must have "
             "(`benchmarks/coverage/vision.py`'s docstring)", "",
             "| zoo | tried | cannot build | cannot run | runs | traced | sound | complete "
             f"| sound and complete / runs (target ≥ {100 * TARGET:.0f} %) |", "|---|---|---|---|---|---|---|---|---|"]
    for z, b in s["by_zoo"].items():
        pct = "n/a" if not b["runs"] else f"{100 * b['sound_and_complete'] / b['runs']:.1f} %"
        lines.append(f"| {z} | {b['tried']} | {b['cannot_build']} | {b['cannot_run']} | {b['runs']} | "
                     f"{b['traced']} | {b['sound']} | {b['complete']} | {b['sound_and_complete']} = {pct} "
                     f"({'met' if b['meets_target'] else 'NOT met'}) |")
    lines += ["", f"- unsound (certificate > {TOL:g}): {s['unsound']}"]
    if s["not_run"]:
        lines.append(f"- not run ({len(s['not_run'])}: the run's time budget was spent first; families run "
                     f"in a seeded random order within each zoo): {', '.join(s['not_run'])}")
    lines += ["", "## What blocks a class", ""]
    for k, whys in s["blocked_by"].items():
        for why, fams in sorted(whys.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- `{k}` ({len(fams)}): {_cell(why)[:300]}: {', '.join(fams)}")
    lines += ["", "## Ops without a rule", ""]
    lines += [f"- `{op}` ({len(f)}): {', '.join(f)}" for op, f in s["unruled_ops"].items()] or ["- none"]
    lines += ["", "## Every family", ""]
    lines += table(["zoo", "family", "model", "params", "input", "stage", "certificate", "sound", "complete",
                    "missing", "unruled ops", "analyse s", "error"], [_row(r) for r in res["rows"]])
    return "\n".join(lines) + "\n"


def _row(r) -> list:
    yes = lambda v: "-" if v is None else ("yes" if v else "**no**")  # noqa: E731
    miss = collections.Counter(m["kind"] for m in (r.get("structure") or {}).get("missing", []))
    err = r.get("error") or {}
    return [r["task"], r["model_type"], r.get("class") or "-", r.get("parameters", "-"),
            "x".join(map(str, r.get("input") or [])) or "-", r["stage"],
            "-" if r["certificate"] is None else f"{r['certificate']:.1e}", yes(r["sound"]), yes(r["complete"]),
            ", ".join(f"{k} {v}" for k, v in sorted(miss.items())) or "-",
            len(r.get("unruled_ops") or {}) if r["traced"] else "-",
            "-" if r.get("analyze_seconds") is None else f"{r['analyze_seconds']:.1f}",
            _cell(f"{err.get('type')}: {err.get('message', '')}")[:160] if err else ""]

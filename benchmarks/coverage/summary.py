"""The coverage run (``python -m benchmarks.coverage``), its totals, blockers and tables."""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import time

from ..provenance import REPO_ROOT, command_line, log, table, write_result
from .family import TARGET_COMPLETE, TARGET_MEDIAN_S, TARGET_RUNS, TASKS, TOL, families, known, run_isolated
from .shrink import RULE

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage"


def git_info() -> dict:
    """The commit and which files differ from it (a run reads it before it starts)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    try:
        head = git("rev-parse", "HEAD").strip()
        status = [ln[3:] for ln in git("status", "--porcelain").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(status),
            "dirty_symgraph": sorted(p for p in status if p.startswith("symgraph/")), "dirty_files": len(status)}


def summarize(rows) -> dict:
    traced = [r for r in rows if r["traced"]]
    causal = [r for r in rows if r["task"] == "causal_lm"]
    causal_traced = [r for r in causal if r["traced"]]
    causal_complete = [r for r in causal_traced if r["complete"]]
    secs = [r["analyze_seconds"] for r in traced if r.get("analyze_seconds") is not None]
    fails = collections.Counter(r["error"]["stage"] for r in rows if r.get("error") and not r["traced"])
    missing, rope_blocked = collections.defaultdict(list), collections.defaultdict(list)
    for r in traced:
        name, st = f"{r['model_type']}/{r['task']}", r.get("structure") or {}
        for k in sorted({m["kind"] for m in st.get("missing", [])}):
            missing[k].append(name)
        if st.get("rope_blocked"):
            rope_blocked[st["rope_blocked"]].append(name)
    blocked, unruled = blocked_by(traced, lambda r: f"{r['model_type']}/{r['task']}")
    pct = len(causal_complete) / len(causal_traced) if causal_traced else None
    return {
        "tried": len(rows), "built": sum(r.get("parameters") is not None for r in rows), "traced": len(traced),
        "sound": sum(bool(r["sound"]) for r in rows), "unsound": sum(r["sound"] is False for r in rows),
        "complete": sum(bool(r["complete"]) for r in rows),
        "complete_and_sound": sum(bool(r["complete"]) and bool(r["sound"]) for r in rows),
        "failures_by_stage": dict(fails),
        "causal_lm": {"tried": len(causal), "traced": len(causal_traced), "complete": len(causal_complete),
                      "complete_fraction": pct, "target": TARGET_COMPLETE,
                      "meets_target": pct is not None and pct >= TARGET_COMPLETE},
        "by_task": {t: counts([r for r in rows if r["task"] == t]) for t in TASKS if any(r["task"] == t for r in rows)},
        "all": counts(rows), "target_runs": TARGET_RUNS,
        "median_analyze_seconds": statistics.median(secs) if secs else None,
        "max_analyze_seconds": max(secs) if secs else None, "target_median_seconds": TARGET_MEDIAN_S,
        "missing_kinds": dict(sorted(missing.items(), key=lambda kv: -len(kv[1]))),
        "blocked_by": blocked, "rope_not_expected": dict(rope_blocked), "unruled_ops": unruled,
    }


#: stages at which transformers itself may fail (its config's validators, its constructor, its
#: forward); a transformers row is out of the denominator only when its error says
#: ``transformers_fails`` (:func:`.family.transformers_fails`), a zoo's row by its stage alone
NOT_TRANSFORMERS = {"config": "cannot build", "build": "cannot build", "eager": "cannot run"}


def theirs(r) -> bool:
    """Whether a row failed for transformers itself (or a zoo), not for us."""
    e = r.get("error") or {}
    if r["traced"] or e.get("stage") not in NOT_TRANSFORMERS:
        return False
    return bool(e.get("transformers_fails", True))


def counts(rows, target: float = TARGET_RUNS) -> dict:
    """A task's (or all rows') counts: ``runs`` is what transformers (a zoo) builds and runs
    (every row but those :func:`theirs`), the denominator of ``fraction`` (sound and complete / runs)."""
    stage = [(r.get("error") or {}).get("stage") if theirs(r) else None for r in rows]
    built = sum(st not in ("config", "build") for st in stage)
    runs = sum(st not in NOT_TRANSFORMERS for st in stage)
    good = sum(bool(r["complete"]) and bool(r["sound"]) for r in rows)
    return {"tried": len(rows), "cannot_build": len(rows) - built, "cannot_run": built - runs,
            "runs": runs, "traced": sum(bool(r["traced"]) for r in rows),
            "sound": sum(bool(r["sound"]) for r in rows),
            "complete": sum(bool(r["complete"]) for r in rows), "sound_and_complete": good,
            "fraction": good / runs if runs else None, "meets_target": bool(runs) and good / runs >= target}


def whys(r) -> list:
    """``[(kind, what blocks it)]`` of a row's missing classes, each once: the ops or patterns the
    analysis recorded (:mod:`.why`), and the frozen ops in the missing module."""
    out: list = []
    frozen = {(b["kind"], b["module"]): b.get("frozen_ops") or [] for b in r.get("blockers") or ()}
    for m in (r.get("structure") or {}).get("missing", []):
        ops = frozen.get((m["kind"], m["module"])) or []
        for why in ([m["why"]] if m.get("why") else []) + [f"no rule for {op}" for op in ops]:
            if (m["kind"], why) not in out:
                out.append((m["kind"], why))
    return out


def blocked_by(rows, name) -> tuple:
    """``({kind: {why: [name(row)]}}, {op: [name(row)]})``: what blocks each missing class
    (:func:`whys`) and the rows with each op without a rule, the most common op first."""
    blocked = collections.defaultdict(lambda: collections.defaultdict(list))
    unruled = collections.defaultdict(list)
    for r in rows:
        for k, why in whys(r):
            blocked[k][why].append(name(r))
        for op in r.get("unruled_ops") or {}:
            unruled[op].append(name(r))
    return {k: dict(v) for k, v in blocked.items()}, dict(sorted(unruled.items(), key=lambda kv: -len(kv[1])))


def escape(x) -> str:
    """``x`` as one Markdown table cell's text."""
    return str(x).replace("|", "\\|").replace("\n", " ")


def yes(v) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def head(title, h) -> list:
    """A table's title, the command and the commit it was made at."""
    dirty = h["git"].get("dirty")
    return [f"# {title}", "", f"- command: `{h['command']}`", f"- commit: `{h['git']['commit']}`" + (
        f" (dirty: the working tree differs from the commit; {len(h['git'].get('dirty_symgraph', []))} files "
        "under symgraph/)" if dirty else "")]


def totals(by, first: str, cannot_build: str, target: float) -> list:
    """The totals table: a row per key of ``by`` (:func:`counts`), sound and complete over what runs."""
    pct = {t: "n/a" if b["fraction"] is None else f"{100 * b['fraction']:.1f} %" for t, b in by.items()}
    return table([first, "tried", cannot_build, "cannot run", "runs", "traced", "sound", "complete",
                  f"sound and complete / runs (target ≥ {100 * target:.0f} %)"],
                 [[t, b["tried"], b["cannot_build"], b["cannot_run"], b["runs"], b["traced"], b["sound"], b["complete"],
                   f"{b['sound_and_complete']} = {pct[t]} ({'met' if b['meets_target'] else 'NOT met'})"]
                  for t, b in by.items()])


def markdown(res: dict) -> str:
    s, h = res["summary"], res["header"]
    c = s["causal_lm"]
    lines = head("Coverage of the transformers library", h) + [
        f"- transformers {h['machine']['transformers']}, torch {h['machine']['torch']}, "
        f"{h['machine']['cores']} cores; {h['jobs']} families at a time, {h['threads']} thread(s) each, "
        f"timeout {h['timeout_s']:.0f} s, memory limit {h['mem_gb']} GB per family; wall {h['wall_seconds']:.0f} s",
        f"- shrink rule: {h['rule']}",
        "",
        "## Totals",
        "",
        "Runs (the denominator): every row but those transformers itself cannot build: a row that "
        "fails to validate its config or construct its class at the shrunk size counts as "
        "transformers' only when transformers' own default config of the family fails the same way "
        "(same exception type; the class constructed on the meta device); otherwise the failure is "
        "the shrink rule's and counts against us. A row whose eager forward fails on our example "
        "inputs counts against us too (no inputs of transformers' own prove it otherwise). Rows of "
        "either kind are listed below with the exception.",
        "",
        "Complete: every MLP, multi-head attention site and rotary embedding the traced graph "
        "holds has its class in the report; units no kept output depends on (a vision layer past "
        "the one a model's features are taken from, a pooling head its classifier does not use) "
        "are dead code, whose weights any map keeps, and are not expected.",
        "",
        *totals({**s["by_task"], "**all**": s["all"]}, "", "transformers cannot build", TARGET_RUNS),
        ""]
    pct = "n/a" if c["complete_fraction"] is None else f"{100 * c['complete_fraction']:.1f} %"
    med = s["median_analyze_seconds"]
    lines += ([f"- causal LM: **{c['complete']} / {c['traced']} complete of those that trace = {pct}** "
               f"(target ≥ {100 * c['target']:.0f} %: {'met' if c['meets_target'] else 'NOT met'})"]
              if c["tried"] else ["- causal LM: not among the tasks of this run"]) + [
        f"- unsound (certificate > tolerance): {s['unsound']}; failures before a trace, by stage: "
        f"{s['failures_by_stage'] or 'none'}",
        f"- median analysis time per traced family: **{med:.2f} s** (max {s['max_analyze_seconds']:.1f} s; "
        f"target ≤ {s['target_median_seconds']:.0f} s: {'met' if med <= s['target_median_seconds'] else 'NOT met'})"
        if med is not None else "- median analysis time: n/a",
        "", "## Blockers", "", "Missing class kinds (families):", ""]
    for k, fams in s["missing_kinds"].items():
        lines.append(f"- `{k}` ({len(fams)}): {', '.join(fams)}")
        for why, bf in sorted((s.get("blocked_by") or {}).get(k, {}).items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  - blocked by: {escape(why)} ({len(bf)}): {', '.join(bf)}")
    lines += [] if s["missing_kinds"] else ["- none"]
    for why, fams in (s.get("rope_not_expected") or {}).items():
        lines.append(f"- not missing: `rope` in {len(fams)} families whose config has rotary "
                     f"parameters, as the graph proves no rope class can exist ({why}): {', '.join(fams)}")
    lines += ["", "Ops without a rule (families):", ""]
    lines += [f"- `{k}` ({len(fams)}): {', '.join(fams)}" for k, fams in s["unruled_ops"].items()] or ["- none"]
    lines += ["", "## Incomplete or unsound families that trace", ""]
    rows = []
    for r in res["rows"]:
        if r["traced"] and (not r["complete"] or r["sound"] is False):
            missing = (r.get("structure") or {}).get("missing", [])
            miss = "; ".join(sorted({m["kind"] + (f" ({m['module']})" if m["module"] else "") for m in missing})[:4])
            miss = (miss or "-") + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
            rows.append([r["model_type"], r["class"], r["task"], _cert(r), escape(miss),
                         escape("; ".join(f"{k}: {w}" for k, w in whys(r)) or "-"),
                         escape(", ".join(r.get("unruled_ops") or {}) or "-")])
    lines += table(["model_type", "class", "task", "certificate", "missing (module)", "blocked by",
                    "ops without a rule"], rows)
    for title, ours in (("Rows that fail before the analysis for a reason of ours (shrink rule, "
                         "example inputs, trace)", True),
                        ("Rows transformers cannot build at its own default config either", False)):
        lines += ["", f"## {title}", ""]
        lines += table(["model_type", "class", "task", "stage", "error"],
                       [[r["model_type"], r["class"], r["task"], (r.get("error") or {}).get("stage"),
                         f"{escape((r.get('error') or {}).get('type'))}: "
                         f"{escape((r.get('error') or {}).get('message', ''))[:200]}"]
                        for r in res["rows"] if not r["traced"] and theirs(r) != ours])
    lines += ["", "## Every family", ""]
    rows = []
    for r in res["rows"]:
        st = r.get("structure") or {}
        rope = "-" if not st else (f"{st['rope_classes']}" + (" (exp.)" if st["rope_expected"] else "")
                                   + (" (none possible)" if st.get("rope_blocked") else ""))
        sec = "-" if r.get("analyze_seconds") is None else f"{r['analyze_seconds']:.2f}"
        rows.append([r["model_type"], r["class"], r["task"], yes(r["traced"]), _cert(r), yes(r["sound"]),
                     yes(r["complete"]), st.get("mlps", "-"), st.get("multihead_attention", "-"), rope,
                     len(r.get("unruled_ops") or {}) if r["traced"] else "-", sec])
    lines += table(["model_type", "class", "task", "traced", "certificate", "sound", "complete", "MLPs", "attn",
                    "rope", "unruled ops", "analyse s"], rows)
    return "\n".join(lines) + "\n"


def _cert(r) -> str:
    return "-" if r["certificate"] is None else f"{r['certificate']:.1e}"


def run(out=None, only=None, tasks=None, jobs: int = 2, timeout: float = 120.0, mem_gb: float | None = 6.0,
        command: str | None = None, log=None) -> dict:
    """The rows of the selected families, summarised; ``coverage.json`` / ``coverage.md`` into
    ``out`` (when given)."""
    from ..harness import machine_info
    t0, git = time.perf_counter(), git_info()  # the commit the rows were produced at
    rows = run_isolated(known(families(tasks, only), only), jobs, timeout, mem_gb, log)
    res = {"header": {"command": command or "python -m benchmarks.coverage", "git": git,
                      "machine": machine_info(), "jobs": jobs,
                      "threads": max(1, (os.cpu_count() or 1) // max(1, jobs)), "timeout_s": timeout,
                      "mem_gb": mem_gb, "tolerance": TOL, "rule": RULE,
                      "tasks": {t: TASKS[t] for t in (tasks or TASKS)}, "only": only,
                      "wall_seconds": time.perf_counter() - t0},
           "summary": summarize(rows), "rows": rows}
    if out:
        write_result(out, ".coverage-", res, markdown, json_name="coverage.json", md_name="coverage.md")
    return res


def parser(prog: str, description: str, out, jobs: int, timeout: float, mem_gb: float = 6.0,
           tasks: bool = True) -> argparse.ArgumentParser:
    """The options of a run over families (this table's, the round trip's, the vision zoos')."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--only", nargs="+", default=None, metavar="FAMILY",
                    help="model types (or class names) to run (default: every one)")
    if tasks:
        ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None)
    ap.add_argument("--out", default=str(out), help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=jobs, help=f"families at a time (default {jobs})")
    ap.add_argument("--timeout", type=float, default=timeout, help=f"seconds per family (default {timeout:g})")
    ap.add_argument("--mem-gb", type=float, default=mem_gb, help=f"address-space limit per family (0: none; "
                    f"default {mem_gb:g})")
    return ap


def main(argv=None) -> int:
    a = parser("python -m benchmarks.coverage", __doc__.splitlines()[0], DEFAULT_OUT, 2, 120.0).parse_args(argv)
    res = run(a.out, a.only, a.tasks, a.jobs, a.timeout, a.mem_gb or None, command_line(argv, "benchmarks.coverage"),
              log=log)
    s, c = res["summary"], res["summary"]["causal_lm"]
    print(f"tried {s['tried']}  traced {s['traced']}  sound {s['sound']}  complete {s['complete']}  "
          f"causal-LM complete {c['complete']}/{c['traced']}  median analyse "
          f"{s['median_analyze_seconds'] or float('nan'):.2f} s  -> {a.out}")
    return 0

"""The totals, blockers and the markdown table of a run; the run itself."""
from __future__ import annotations


import argparse
import collections
import os
import shlex
import statistics
import subprocess
import sys
import time

from ..provenance import REPO_ROOT, log, register, staged, table, write_json

from .constants import DEFAULT_OUT, TARGET_COMPLETE, TARGET_MEDIAN_S, TARGET_RUNS, TASKS, TOL
from .family import families, run_isolated


# --- summary and outputs ------------------------------------------------------------------------


def git_info() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    try:
        head = git("rev-parse", "HEAD").strip()
        status = [ln[3:] for ln in git("status", "--porcelain").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(status),
            "dirty_symgraph": sorted(p for p in status if p.startswith("symgraph/")),
            "dirty_files": len(status)}


def summarize(rows) -> dict:
    traced = [r for r in rows if r["traced"]]
    causal = [r for r in rows if r["task"] == "causal_lm"]
    causal_traced = [r for r in causal if r["traced"]]
    causal_complete = [r for r in causal_traced if r["complete"]]
    secs = [r["analyze_seconds"] for r in traced if r.get("analyze_seconds") is not None]
    fails = collections.Counter()
    for r in rows:
        if r.get("error") and not r["traced"]:
            fails[r["error"]["stage"]] += 1
    missing = collections.defaultdict(list)
    blocked: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    unruled = collections.defaultdict(list)
    for r in traced:
        fam = f"{r['model_type']}/{r['task']}"
        for k in sorted({m["kind"] for m in r["structure"]["missing"]} if r.get("structure") else ()):
            missing[k].append(fam)
        for k, why in _whys(r):
            blocked[k][why].append(fam)
        for op in r.get("unruled_ops", {}):
            unruled[op].append(f"{r['model_type']}/{r['task']}")
    pct = len(causal_complete) / len(causal_traced) if causal_traced else None
    return {
        "tried": len(rows), "built": sum(r.get("parameters") is not None for r in rows),
        "traced": len(traced),
        "sound": sum(bool(r["sound"]) for r in rows),
        "unsound": sum(r["sound"] is False for r in rows),
        "complete": sum(bool(r["complete"]) for r in rows),
        "complete_and_sound": sum(bool(r["complete"]) and bool(r["sound"]) for r in rows),
        "failures_by_stage": dict(fails),
        "causal_lm": {"tried": len(causal), "traced": len(causal_traced), "complete": len(causal_complete),
                      "complete_fraction": pct, "target": TARGET_COMPLETE,
                      "meets_target": pct is not None and pct >= TARGET_COMPLETE},
        "by_task": {t: _counts([r for r in rows if r["task"] == t])
                    for t in TASKS if any(r["task"] == t for r in rows)},
        "all": _counts(rows), "target_runs": TARGET_RUNS,
        "median_analyze_seconds": statistics.median(secs) if secs else None,
        "max_analyze_seconds": max(secs) if secs else None,
        "target_median_seconds": TARGET_MEDIAN_S,
        "missing_kinds": {k: v for k, v in sorted(missing.items(), key=lambda kv: -len(kv[1]))},
        "blocked_by": {k: dict(v) for k, v in blocked.items()},
        "rope_not_expected": _by_reason(traced),
        "unruled_ops": {k: v for k, v in sorted(unruled.items(), key=lambda kv: -len(kv[1]))},
    }


#: stages at which transformers itself may fail: its config's validators, its model's
#: constructor, its own forward on the example inputs. A transformers row is out of the
#: denominator only when its error says ``transformers_fails`` (:func:`.family.transformers_fails`:
#: transformers' own default config fails the same way); rows without that mark (a zoo's) by stage
NOT_TRANSFORMERS = {"config": "cannot build", "build": "cannot build", "eager": "cannot run"}


def theirs(r) -> bool:
    """Whether a row failed for transformers itself (or a zoo), not for us."""
    e = r.get("error") or {}
    if r["traced"] or e.get("stage") not in NOT_TRANSFORMERS:
        return False
    return bool(e.get("transformers_fails", True))


def _counts(rows) -> dict:
    """A task's (or all rows') counts: ``runs`` is what transformers builds and runs eagerly
    (every row but those :func:`theirs`), the denominator of ``fraction`` (sound and complete / runs)."""
    stage = [(r.get("error") or {}).get("stage") if theirs(r) else None for r in rows]
    built = sum(st not in ("config", "build") for st in stage)
    runs = sum(st not in NOT_TRANSFORMERS for st in stage)
    good = sum(bool(r["complete"]) and bool(r["sound"]) for r in rows)
    return {"tried": len(rows), "cannot_build": len(rows) - built, "cannot_run": built - runs,
            "runs": runs, "traced": sum(bool(r["traced"]) for r in rows),
            "sound": sum(bool(r["sound"]) for r in rows),
            "complete": sum(bool(r["complete"]) for r in rows), "sound_and_complete": good,
            "fraction": good / runs if runs else None,
            "meets_target": bool(runs) and good / runs >= TARGET_RUNS}


def _whys(r) -> list:
    """``[(kind, what blocks it)]`` of a row's missing classes, each once: the ops or patterns
    the analysis recorded (:mod:`.why`), and the ops without a rule in the missing module."""
    out: list = []
    frozen = {(b["kind"], b["module"]): b.get("frozen_ops") or [] for b in r.get("blockers") or ()}
    for m in (r.get("structure") or {}).get("missing", []):
        ops = frozen.get((m["kind"], m["module"])) or []
        for why in ([m["why"]] if m.get("why") else []) + [f"no rule for {op}" for op in ops]:
            if (m["kind"], why) not in out:
                out.append((m["kind"], why))
    return out


def _by_reason(traced) -> dict:
    """``{why: [model_type/task, ...]}`` of the rows whose graph rules out a rope class."""
    out = collections.defaultdict(list)
    for r in traced:
        why = (r.get("structure") or {}).get("rope_blocked")
        if why:
            out[why].append(f"{r['model_type']}/{r['task']}")
    return dict(out)


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def markdown(res: dict) -> str:
    s, h = res["summary"], res["header"]
    c = s["causal_lm"]
    lines = [
        "# Coverage of the transformers library",
        "",
        f"- command: `{h['command']}`",
        f"- commit: `{h['git']['commit']}`" + (" (dirty: the working tree differs from the commit; "
                                                f"{len(h['git'].get('dirty_symgraph', []))} files under symgraph/)"
                                                if h['git'].get('dirty') else ""),
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
    ]
    lines += _totals(s)
    pct = "n/a" if c["complete_fraction"] is None else f"{100 * c['complete_fraction']:.1f} %"
    med = s["median_analyze_seconds"]
    lines += [""] + ([
        f"- causal LM: **{c['complete']} / {c['traced']} complete of those that trace = {pct}** "
        f"(target ≥ {100 * c['target']:.0f} %: {'met' if c['meets_target'] else 'NOT met'})"]
        if c["tried"] else ["- causal LM: not among the tasks of this run"]) + [
        f"- unsound (certificate > tolerance): {s['unsound']}; failures before a trace, by stage: "
        f"{s['failures_by_stage'] or 'none'}",
        f"- median analysis time per traced family: **{med:.2f} s** (max {s['max_analyze_seconds']:.1f} s; "
        f"target ≤ {s['target_median_seconds']:.0f} s: {'met' if med <= s['target_median_seconds'] else 'NOT met'})"
        if med is not None else "- median analysis time: n/a",
        "",
        "## Blockers",
        "",
        "Missing class kinds (families):",
        "",
    ]
    for k, fams in s["missing_kinds"].items():
        lines.append(f"- `{k}` ({len(fams)}): {', '.join(fams)}")
        for why, bf in sorted((s.get("blocked_by") or {}).get(k, {}).items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  - blocked by: {_cell(why)} ({len(bf)}): {', '.join(bf)}")
    if not s["missing_kinds"]:
        lines.append("- none")
    for why, fams in (s.get("rope_not_expected") or {}).items():
        lines.append(f"- not missing: `rope` in {len(fams)} families whose config has rotary "
                     f"parameters, as the graph proves no rope class can exist ({why}): {', '.join(fams)}")
    lines += ["", "Ops without a rule (families):", ""]
    for k, fams in s["unruled_ops"].items():
        lines.append(f"- `{k}` ({len(fams)}): {', '.join(fams)}")
    if not s["unruled_ops"]:
        lines.append("- none")
    lines += ["", "## Incomplete or unsound families that trace", ""]
    rows = []
    for r in res["rows"]:
        if r["traced"] and (not r["complete"] or r["sound"] is False):
            miss = "; ".join(sorted({f"{m['kind']}" + (f" ({m['module']})" if m["module"] else "")
                                     for m in (r.get("structure") or {}).get("missing", [])})[:4]) or "-"
            why = "; ".join(f"{k}: {w}" for k, w in _whys(r)) or "-"
            n_miss = len((r.get("structure") or {}).get("missing", []))
            if n_miss > 4:
                miss += f" (+{n_miss - 4} more)"
            cert = "-" if r["certificate"] is None else f"{r['certificate']:.1e}"
            rows.append([r["model_type"], r["class"], r["task"], cert, _cell(miss), _cell(why),
                         _cell(", ".join(r.get("unruled_ops") or {}) or "-")])
    lines += table(["model_type", "class", "task", "certificate", "missing (module)", "blocked by",
                    "ops without a rule"], rows)
    for title, ours in (("Rows that fail before the analysis for a reason of ours (shrink rule, "
                         "example inputs, trace)", True),
                        ("Rows transformers cannot build at its own default config either", False)):
        lines += ["", f"## {title}", ""]
        lines += table(["model_type", "class", "task", "stage", "error"],
                       [[r["model_type"], r["class"], r["task"], (r.get("error") or {}).get("stage"),
                         f"{_cell((r.get('error') or {}).get('type'))}: "
                         f"{_cell((r.get('error') or {}).get('message', ''))[:200]}"]
                        for r in res["rows"] if not r["traced"] and theirs(r) != ours])
    lines += ["", "## Every family", ""]
    rows = []
    for r in res["rows"]:
        st = r.get("structure") or {}
        cert = "-" if r["certificate"] is None else f"{r['certificate']:.1e}"
        rope = "-" if not st else (f"{st['rope_classes']}" + (" (exp.)" if st["rope_expected"] else "")
                                   + (" (none possible)" if st.get("rope_blocked") else ""))
        sec = "-" if r.get("analyze_seconds") is None else f"{r['analyze_seconds']:.2f}"
        yes = lambda v: "-" if v is None else ("yes" if v else "**no**")  # noqa: E731
        rows.append([r["model_type"], r["class"], r["task"], yes(r["traced"]), cert, yes(r["sound"]),
                     yes(r["complete"]), st.get("mlps", "-"), st.get("multihead_attention", "-"), rope,
                     len(r.get("unruled_ops") or {}) if r["traced"] else "-", sec])
    lines += table(["model_type", "class", "task", "traced", "certificate", "sound", "complete", "MLPs", "attn",
                    "rope", "unruled ops", "analyse s"], rows)
    return "\n".join(lines) + "\n"


def _totals(s) -> list:
    """The totals table: per task and all rows, with sound and complete over what runs."""
    lines = ["| | tried | transformers cannot build | cannot run | runs | traced | sound | complete "
             f"| sound and complete / runs (target ≥ {100 * TARGET_RUNS:.0f} %) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t, b in [*s["by_task"].items(), ("**all**", s["all"])]:
        pct = "n/a" if b["fraction"] is None else f"{100 * b['fraction']:.1f} %"
        lines.append(f"| {t} | {b['tried']} | {b['cannot_build']} | {b['cannot_run']} | {b['runs']} "
                     f"| {b['traced']} | {b['sound']} | {b['complete']} | {b['sound_and_complete']} = "
                     f"{pct} ({'met' if b['meets_target'] else 'NOT met'}) |")
    return lines


RULE = ("widths x 64/main width (multiple of 8; a list of one width per layer cut and scaled); heads -> "
        "power of two <= 4, kv heads keep MHA/MQA else 2, head dims 16; main layer counts -> 2, other "
        "layer counts and stage depths -> 1; experts -> 4, shared -> 1, per token -> 2 (also when left "
        "None beside an MoE width), routing/state groups -> 1, a group count equal to a width (one per "
        "channel) and a codebook_dim equal to a width shrunk with it, a ..._hidden_size equal to another tower's width -> 64; vocab (also "
        "per-layer input vocabularies; a vocab_size left None) -> 256 (token ids renumbered); image "
        "size -> 64; attention windows -> 16; a codec's num_filters -> 8; per-layer attributes of "
        "heterogeneous configs by their global value; recursively in sub-configs "
        "(benchmarks.coverage.shrink). Derived for the configs' validators "
        "(benchmarks.coverage.consistent): the kept layers hold every kind of each per-layer list "
        "(the first layers where the class refuses that), every per-layer list follows them; mrope "
        "sections sum to half the shrunk rotary width; a Swin window fits the last stage; qualified "
        "counts partitioning the layers set their number; a repeated layer pattern spells them; "
        "parts of the width and sizes equal to it follow it; state and summed head widths derived")


def run(out=None, only=None, tasks=None, jobs: int = 2, timeout: float = 120.0, mem_gb: float | None = 6.0,
        command: str | None = None, log=None) -> dict:
    """Run the benchmark over the selected families; write ``coverage.json`` / ``coverage.md``
    into ``out`` (when given) and return the result."""
    from ..harness import machine_info
    t0 = time.perf_counter()
    git = git_info()  # before the run: the commit the rows were produced at
    fams = families(tasks, only)
    if only:
        unknown = sorted(set(only) - {f[0] for f in fams} - {f[1] for f in fams})
        if unknown:
            raise SystemExit(f"unknown families: {', '.join(unknown)}")
    rows = run_isolated(fams, jobs, timeout, mem_gb, log)
    res = {"header": {"command": command or "python -m benchmarks.coverage", "git": git,
                      "machine": machine_info(), "jobs": jobs,
                      "threads": max(1, (os.cpu_count() or 1) // max(1, jobs)), "timeout_s": timeout,
                      "mem_gb": mem_gb, "tolerance": TOL, "rule": RULE,
                      "tasks": {t: TASKS[t] for t in (tasks or TASKS)}, "only": only,
                      "wall_seconds": time.perf_counter() - t0},
           "summary": summarize(rows), "rows": rows}
    if out:
        with staged(out, ".coverage-") as tmp:
            write_json(tmp / "coverage.json", res)
            (tmp / "coverage.md").write_text(markdown(res))
        register(out, ["coverage.json", "coverage.md"])
    return res


def family_args(prog: str, description: str, out, jobs: int, timeout: float, argv) -> tuple:
    """The options of a run over the coverage's families (this table's, the round trip's) parsed
    from ``argv``, and the command line that ran: ``(namespace, command)``."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--only", nargs="+", default=None, metavar="FAMILY",
                    help="model types (or class names) to run (default: every one)")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None)
    ap.add_argument("--out", default=str(out), help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=jobs, help=f"families at a time (default {jobs})")
    ap.add_argument("--timeout", type=float, default=timeout, help=f"seconds per family (default {timeout:g})")
    ap.add_argument("--mem-gb", type=float, default=6.0, help="address-space limit per family (0: none)")
    a = ap.parse_args(argv)
    return a, " ".join([prog] + [shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)])


def main(argv=None) -> int:
    a, command = family_args("python -m benchmarks.coverage", __doc__.splitlines()[0], DEFAULT_OUT, 2, 120.0, argv)
    res = run(a.out, a.only, a.tasks, a.jobs, a.timeout, a.mem_gb or None, command,
              log=log)
    s = res["summary"]
    c = s["causal_lm"]
    print(f"tried {s['tried']}  traced {s['traced']}  sound {s['sound']}  complete {s['complete']}  "
          f"causal-LM complete {c['complete']}/{c['traced']}  median analyse "
          f"{s['median_analyze_seconds'] or float('nan'):.2f} s  -> {a.out}")
    return 0

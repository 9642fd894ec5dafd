"""``symgraph.merge`` before and after a change of the merge engine, on the same models:
``python -m benchmarks.bench_engine_equivalence --before DIR [--cases ...] [--out DIR]``.

``DIR`` is a checkout of the commit to compare with (e.g. ``git worktree add /tmp/before
fa3d22b``). Each case (:func:`benchmarks.engine_equivalence_worker.case`: tiny seeded models of
the suite's architectures and the merge settings users call) runs in a fresh process once with
``DIR``'s ``symgraph`` and once with this tree's; the merged states are compared tensor by
tensor: the largest absolute difference, relative to the largest entry of that tensor, and the
tensor where it is. Writes ``results.json`` and ``report.md`` (both commits recorded) into
``--out`` (default ``benchmarks/results/engine_equivalence``)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .provenance import REPO_ROOT, command_line, git_state, log, table, write_result

WORKER = Path(__file__).resolve().parent / "engine_equivalence_worker.py"
CASES = ("mlp/average", "mlp/regmean", "mlp/repair", "mlp/universe_regmean",
         "llama/average", "llama/unaligned", "llama/activations", "llama/fisher", "llama/regmean",
         "llama/repair", "llama/universe", "llama/circuits", "llama/full_groups", "llama/weights_1_3",
         "gpt2/average", "gpt2/untie", "gpt2/regmean", "bert/average", "bert/repair", "vit/average")


def _run(root: str, case: str, out: str) -> dict:
    p = subprocess.run([sys.executable, str(WORKER), case, out], env={**os.environ, "PYTHONPATH": root},
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _compare(a: str, b: str) -> dict:
    from safetensors.torch import load_file
    x, y = load_file(a), load_file(b)
    if set(x) != set(y):
        return {"same_keys": False, "only_before": sorted(set(x) - set(y))[:3],
                "only_after": sorted(set(y) - set(x))[:3]}
    worst, where, bitwise = 0.0, None, True
    for k in x:
        if x[k].shape != y[k].shape:
            return {"same_keys": True, "shape_differs": k}
        d = float((x[k] - y[k]).abs().max()) if x[k].numel() else 0.0
        scale = float(x[k].abs().max()) if x[k].numel() else 0.0
        rel = d / scale if scale else d
        bitwise &= d == 0.0
        if rel > worst:
            worst, where = rel, k
    return {"same_keys": True, "bitwise": bitwise, "max_rel_diff": worst, "at": where}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "engine_equivalence"))
    a = ap.parse_args(argv)
    before = os.path.abspath(a.before)
    before_commit = subprocess.run(["git", "-C", before, "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() or "?"
    rows, shown = [], f"<checkout of {before_commit}>"
    with tempfile.TemporaryDirectory() as tmp:
        fa, fb = os.path.join(tmp, "before.safetensors"), os.path.join(tmp, "after.safetensors")
        for c in a.cases:
            ra, rb = _run(before, c, fa), _run(str(REPO_ROOT), c, fb)
            ra = {k: v.replace(before, shown) if isinstance(v, str) else v for k, v in ra.items()}  # no machine path
            row = {"case": c, "before": ra, "after": rb}
            if "error" not in ra and "error" not in rb:
                row |= _compare(fa, fb)
            rows.append(row)
            log(f"  {c}: {row.get('max_rel_diff', row.get('error', ra.get('error') or rb.get('error')))}")
    state = git_state()
    write_result(a.out, ".engine-", {"before": before_commit, "after": state, "cases": rows,
                                     "written": time.strftime("%Y-%m-%dT%H:%M:%S")},
                 lambda _: report(rows, before_commit, state),
                 command=command_line([a2 if a2 != a.before else shown for a2 in (argv or sys.argv[1:])]))
    return 0


def report(rows, before, state) -> str:
    lines = ["# symgraph.merge before and after the one engine", "",
             f"Written by `python -m benchmarks.bench_engine_equivalence --before <checkout of {before}>` "
             f"at {state or '?'}: each case's tiny "
             "seeded models merged by `symgraph.merge` in a fresh process with the older tree's symgraph "
             f"(`{before}`) and with this one; the merged states compared tensor by tensor.", ""]
    cells = []
    for r in rows:
        if "max_rel_diff" in r:
            cells.append([r["case"], f"{r['before']['seconds']:.2f}", f"{r['after']['seconds']:.2f}",
                          "yes" if r["bitwise"] else "no", f"{r['max_rel_diff']:.1e}", r["at"] or "–"])
        else:
            err = r["before"].get("error") or r["after"].get("error") or r.get("shape_differs") or r.get("only_after")
            cells.append([r["case"], "–", "–", "–", "–", err])
    lines += table(["case", "before s", "after s", "bitwise equal", "max |Δ| / max |θ|", "at"], cells,
                   [None, "r", "r", None, "r", None])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

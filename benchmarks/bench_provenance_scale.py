"""Benchmark: ``symgraph compare --out-of-core`` on a 1.1B-shaped bf16 pair (target: ≤ 2 GB peak RSS).

:mod:`benchmarks.bench_scale`'s checkpoints (TinyLlama-1.1B's shape, random bf16 weights): A
(seed 0), an independent C (seed 1), and B = A moved by a random element of the full groups,
written tensor by tensor (:func:`write_moved`). Each comparison runs ``symgraph compare`` in a
child process whose wall time and peak RSS are measured: ``copy``, ``compare A B --out-of-core``
(expected "same"), and ``independent``, ``compare A C --out-of-core --null N`` (expected
"unrelated"; each null draw is one more alignment, of a shuffled view of C).

``python -m benchmarks.bench_provenance_scale [--layers 22] [--null 1] [--work DIR] [--out DIR]``
writes ``benchmarks/results/provenance_scale/`` (report.md, results.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import types
from pathlib import Path

from .provenance import REPO_ROOT, git_state, table, write_result
from .scale.checkpoints import ensure_pair, llama_config, model_sizes
from .scale.common import DEFAULT_WORK, GB, SHARD_SIZE, child_env, log, measure

OUT = Path(__file__).parent / "results" / "provenance_scale"
TARGET_GB = 2.0
EXPECTED = {"copy": "same", "independent": "unrelated"}


def write_moved(src: str, dst: str, seed: int = 0, work=None) -> dict:
    """Checkpoint ``src`` moved by ``random_transform(seed)`` of its meta model's report into ``dst``,
    one unit (a norm's gain with its readers, or a tensor) at a time; ``{"seconds", "bytes"}``."""
    import time

    import torch

    from symgraph.checkpoints.sharded import Checkpoint, ShardWriter, parse_size
    from symgraph.merging.engine.views import Aligned
    from symgraph.report.api import analyze
    t0 = time.perf_counter()
    c = Checkpoint(src)
    rep = analyze(c.model)
    moved = types.SimpleNamespace(elements=rep.random_transform(seed=seed).elements, report_b=rep)
    view = Aligned(c, moved, c, None, work or torch.float32)
    tmp = Path(dst).with_name(f".{Path(dst).name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(str(tmp), parse_size(SHARD_SIZE), [(k, c.shapes[k], c.dtypes[k]) for k in c.keys])
    for k in c.keys:
        writer.add(k, view.fetch(c.param_of.get(k, k)))
    writer.close()
    view.clear()
    for f in ("config.json", "generation_config.json"):
        if (Path(src) / f).exists():
            shutil.copy2(Path(src) / f, tmp / f)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return {"seconds": time.perf_counter() - t0, "bytes": sum(p.stat().st_size for p in Path(dst).glob("*"))}


def _compare(a: str, b: str, null: int, log_prefix: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "symgraph", "compare", a, b, "--out-of-core", "--null", str(null), "--json"]
    r = measure(cmd, timeout=timeout, env=child_env(), cwd=REPO_ROOT, log_prefix=log_prefix)
    row = {"cmd": cmd[2:], "rc": r["rc"], "timed_out": r["timed_out"], "wall_s": r["wall_s"],
           "peak_rss_gb": r["peak_rss_bytes"] / GB, "error": r.get("error")}
    if r["rc"] == 0:
        rec = json.loads(Path(r["stdout_log"]).read_text())
        row.update({k: rec[k] for k in ("verdict", "mode", "statistic", "excess", "p_value", "null",
                                         "max_rel_distance", "tolerance", "group_kinds")})
    log(f"  {' '.join(cmd[4:6])}: {row.get('verdict')} in {row['wall_s']:.0f} s, peak RSS {row['peak_rss_gb']:.2f} GB")
    return row


def run(layers: int | None, null: int, work: Path, timeout: float) -> dict:
    config = llama_config("1b", layers)
    pair = ensure_pair(work, "1b", layers)
    d = Path(pair["dir"])
    moved = d / "a_moved"
    if not (moved / "config.json").exists():
        log(f"  writing {moved} (A moved by a random full-group element) ...")
        r = measure([sys.executable, "-m", "benchmarks.bench_provenance_scale", "--_moved", pair["a"], str(moved)],
                    env=child_env(), cwd=REPO_ROOT, timeout=timeout)
        if r["rc"] != 0:
            raise RuntimeError(f"writing {moved} failed (rc {r['rc']}): {r.get('error')}")
        pair["moved_peak_rss_gb"] = r["peak_rss_bytes"] / GB
    rows = {"copy": _compare(pair["a"], str(moved), 0, str(d / "log-compare-copy"), timeout),
            "independent": _compare(pair["a"], pair["b"], null, str(d / "log-compare-independent"), timeout)}
    ok = {name: rows[name].get("verdict") == want for name, want in EXPECTED.items()}
    return {"commit": git_state(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "shape": "1b", "layers": config.num_hidden_layers, "full_layers": 22, "dtype": "bfloat16",
            "sizes": model_sizes(config), "null": null, "target_peak_rss_gb": TARGET_GB, "pair": pair,
            "rows": rows, "verdicts_ok": ok,
            "peak_rss_ok": all(r["peak_rss_gb"] <= TARGET_GB for r in rows.values())}


def markdown(r) -> str:
    lines = [f"# `symgraph compare --out-of-core` on a 1.1B-shaped bf16 pair (commit {r['commit']}, {r['when']})", "",
             f"TinyLlama-1.1B's shape with {r['layers']} of {r['full_layers']} decoder layers "
             f"({r['sizes']['parameters'] / 1e9:.2f} B parameters, {r['sizes']['bytes'] / GB:.2f} GB per model), "
             "random bf16 weights; B = A moved by a random element of the full groups, written tensor by "
             "tensor; C independent. Each comparison in its own process. Target: peak RSS ≤ "
             f"{r['target_peak_rss_gb']} GB.", ""]
    rows = [[name, x.get("verdict", "failed: " + str(x.get("error"))), expected,
             f"{x.get('max_rel_distance', float('nan')):.2e}", f"{x.get('excess', float('nan')):.3f}",
             len(x.get("null") or []), f"{x['wall_s']:.0f}", f"{x['peak_rss_gb']:.2f}"]
            for name, expected in EXPECTED.items() for x in [r["rows"][name]]]
    lines += table(["pair", "verdict", "expected", "max rel. distance", "excess", "null draws", "wall s",
                    "peak RSS GB"], rows)
    lines += ["", f"Verdicts as expected: {all(r['verdicts_ok'].values())}; peak RSS within the target: "
              f"{r['peak_rss_ok']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--_moved"]:
        print(json.dumps(write_moved(sys.argv[2], sys.argv[3])))
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_provenance_scale",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all 22)")
    ap.add_argument("--null", type=int, default=1, help="shuffled copies for the independent pair (default 1)")
    ap.add_argument("--work", default=DEFAULT_WORK, help=f"checkpoints and logs (default {DEFAULT_WORK})")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per comparison")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    res = run(a.layers, a.null, Path(a.work), a.timeout)
    write_result(a.out, ".provenance-scale-", res, markdown)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``symgraph rotate`` of a 1.1B-shaped LLaMA checkpoint out of core (target: within 2 GB): a
random bf16 checkpoint of the scale benchmark's ``1b`` shape (22 layers unless ``--layers``),
rotated by the command in a fresh process under ``--memory-budget``; its peak resident memory
and time, and a check of the output against the input (same keys, shapes and dtypes; folded norm
gains one).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .bench_rotate import header
from .provenance import commit_info, command_line, log, write_beside
from .scale.checkpoints import llama_config, write_checkpoint
from .scale.common import child_env, measure


def _check(src: Path, out: Path) -> dict:
    from safetensors import safe_open
    meta, ones = {src: {}, out: {}}, True
    for d in (src, out):
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    meta[d][k] = (tuple(s.get_shape()), s.get_dtype())
                    if d == out and k.endswith("norm.weight"):
                        ones &= bool((h.get_tensor(k) == 1).all())
    return {"same_keys_shapes_dtypes": meta[src] == meta[out], "tensors": len(meta[out]), "norm_gains_one": ones}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--budget", default="1GB")
    p.add_argument("--work", default=None, help="where the checkpoints are written (default: a temporary directory)")
    p.add_argument("--out", default="benchmarks/results/rotate")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-rotate-scale-"))
    src, dst = work / "llama-1b", work / "llama-1b-rotated"
    try:
        if not (src / "config.json").is_file():
            log(f"bench_rotate_scale: writing a 1.1B-shaped bf16 checkpoint ({args.layers} layers) into {src}")
            write_checkpoint(src, llama_config("1b", args.layers), seed=0)
        cmd = [sys.executable, "-m", "symgraph", "rotate", str(src), "--out", str(dst), "--memory-budget",
               args.budget, "--force"]
        log("bench_rotate_scale: " + " ".join(cmd))
        r = measure(cmd, env=child_env())
        record = {"command": command_line(argv, "benchmarks.bench_rotate_scale"), "commit": commit_info(),
                  "layers": args.layers, "budget": args.budget, "rc": r["rc"], "wall_s": r["wall_s"],
                  "user_s": r["user_s"], "peak_rss_bytes": r["peak_rss_bytes"], "error": r.get("error"),
                  "printed": r.get("stdout", "").strip().splitlines()[-1:] if r.get("stdout") else []}
        if r["rc"] == 0:
            record["check"] = _check(src, dst)
            record["record"] = json.loads((dst / "symgraph_rotate.json").read_text())["symgraph_rotate"]
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    md = "\n".join(header("symgraph rotate, 1.1B-shaped checkpoint out of core", record) + [
        f"{args.layers} layers of the `1b` shape (hidden 2048, MLP 5632, 32 heads / 4 KV heads, vocabulary 32000), "
        f"bf16, random weights. `symgraph rotate --memory-budget {args.budget}` in a fresh process: "
        f"exit {record['rc']}, {record['wall_s']:.1f} s wall ({record['user_s']:.1f} s CPU), peak RSS "
        f"{record['peak_rss_bytes'] / 1e9:.2f} GB.", "", f"Output check: {record.get('check')}", ""])
    write_beside(Path(args.out) / "scale.json", record, md, command=record["command"])
    print(md)


if __name__ == "__main__":
    main()

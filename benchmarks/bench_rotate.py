"""Rotations for quantization (issue 64): briefly trained zoo models of several families, their
held-out loss in float and under simulated quantization, without rotation and rotated by
``symgraph.rotate`` (randomized Hadamard, Haar-random, learned), and the share of the int4
loss gap each rotation closes.

    python -m benchmarks.bench_rotate [--archs llama gpt2 mixtral bert] [--learn-steps 30]
        [--train-steps 150] [--out benchmarks/results/rotate]

Quantizer (``symgraph.testing.quantize``, fake quantization): weights round-to-nearest,
symmetric, in groups of 128 inputs (a row of fewer inputs is one group), the output head kept;
activations per token, symmetric, at every linear layer's input. Stacked expert weights
(Mixtral's experts) are rounded along their input and the experts' input per token; the
experts' down projection input (inside their forward) stays in floating point. Settings: ``W4`` (weights int4, activations float), ``W4A8``,
``W4A4``, ``W8A8``. Gap closed: ``(L_W4(none) − L_W4(rot)) / (L_W4(none) − L_float)``.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import symgraph
from symgraph.testing import quantize as Q

from . import evaluate, train
from .provenance import commit_info, command_line, log, table, write_result

__all__ = ["SETTINGS", "quantized_loss", "run_arch", "main"]

#: ``name: (weight bits, activation bits)``; None: not rounded.
SETTINGS = {"float": (None, None), "W4": (4, None), "W4A8": (4, 8), "W4A4": (4, 4), "W8A8": (8, 8)}
GROUP = 128
EVAL_BATCHES = 4
LEARN_BATCHES = 4


def quantized_loss(model, arch, batches, wbits, abits) -> float:
    """Held-out loss of ``model`` with weights rounded to ``wbits`` and linear inputs to ``abits``."""
    m = model if wbits is None else Q.quantize_weights(model, wbits, GROUP)
    with torch.no_grad(), Q.activations(m, abits) if abits is not None else contextlib.nullcontext():
        losses = [float(evaluate.batch_loss(m, arch, b)) for b in batches]
    return sum(losses) / len(losses)


def _rotated(model, arch, how, learn_steps, quarot=None):
    if how == "none":
        return model, {}
    if how == "quarot":
        from .rotate_quarot import quarot_rotated
        t0 = time.perf_counter()
        m = quarot_rotated(model, quarot)
        return m, {"certificate": _deviation(model, m, arch), "seconds": time.perf_counter() - t0,
                   "classes": {"QuaRot's own code": 1}}
    t0 = time.perf_counter()
    kw = {}
    if how == "learned":
        data = evaluate.eval_batches(arch, "train", max_batches=LEARN_BATCHES)
        kw = dict(data=data, steps=learn_steps, lr=1e-2, weight_bits=4, act_bits=8, group_size=GROUP,
                  loss_fn=lambda m, b: evaluate.batch_loss(m, arch, b))
    res = symgraph.rotate(model, how=how, seed=0, **kw)
    info = {"certificate": res.error, "untied": res.untied, "seconds": time.perf_counter() - t0,
            "classes": {k: len(v) for k, v in res.roles.items()}}
    if res.learned:
        info["learned"] = {k: v for k, v in res.learned.items() if k != "seconds"}
    return res.model, info


def _deviation(model, other, arch) -> float:
    """Largest relative change of the logits on one evaluation batch (float32)."""
    b = evaluate.eval_batches(arch, "eval", max_batches=1)[0]
    with torch.no_grad():
        x, y = (evaluate.model_logits(m, arch, b).double() for m in (model, other))
    return float((x - y).norm() / x.norm())


def run_arch(arch: str, hows, learn_steps: int, train_steps: int, quarot=None) -> dict:
    """Losses of ``arch`` (trained ``train_steps`` steps, seed 0, quick size) per rotation and setting."""
    model = train.train_model(arch, seed=0, size="quick", steps=train_steps)
    batches = evaluate.eval_batches(arch, "eval", max_batches=EVAL_BATCHES)
    out = {"arch": arch, "rows": {}}
    hows = list(hows) + (["quarot"] if quarot and arch == "llama" else [])
    for how in hows:
        log(f"bench_rotate: {arch} {how}")
        m, info = _rotated(model, arch, how, learn_steps, quarot)
        losses = {name: quantized_loss(m, arch, batches, w, a) for name, (w, a) in SETTINGS.items()}
        out["rows"][how] = {"loss": losses, **info}
    base = out["rows"]["none"]["loss"]
    gap = base["W4"] - base["float"]
    for how, row in out["rows"].items():
        row["w4_gap_closed"] = (base["W4"] - row["loss"]["W4"]) / gap if gap > 0 else None
    return out


def markdown(record) -> str:
    lines = ["# Rotations for quantization (issue 64)", "",
             f"Command: `{record['command']}`  ", f"Commit: `{record['commit']['commit']}` "
             f"(tracked files differ: {record['commit']['dirty']})", "",
             f"Held-out loss (quick zoo models, seed 0, {record['train_steps']} training steps; first "
             f"{EVAL_BATCHES} evaluation batches). Weights RTN symmetric, groups of {GROUP} inputs (a row of "
             "fewer inputs: one group), head kept; activations per token at every linear input. "
             "Gap closed: share of the W4 loss gap to float that the rotation removes.", ""]
    header = ["model", "rotation", *SETTINGS, "W4 gap closed", "certificate", "classes"]
    rows = []
    for r in record["archs"]:
        for how, row in r["rows"].items():
            gap = row["w4_gap_closed"]
            rows.append([r["arch"], how, *(f"{row['loss'][s]:.4f}" for s in SETTINGS),
                         "-" if how == "none" or gap is None else f"{100 * gap:.0f}%",
                         f"{row['certificate']:.1e}" if "certificate" in row else "-",
                         ", ".join(f"{k} {v}" for k, v in row.get("classes", {}).items()) or "-"])
    lines += table(header, rows, ["l", "l", *["r"] * (len(header) - 2)])
    lines += ["", "Notes: " + record["notes"], ""]
    if record.get("quarot"):
        lines += [f"QuaRot: spcl/QuaRot at `{record['quarot']['commit']}`, its `fake_quant` rotation code run "
                  "unchanged on the CPU through three shims (benchmarks/rotate_quarot.py: "
                  "fast_hadamard_transform in PyTorch, `.cuda()` as the identity, an empty accelerate), with "
                  "its online Hadamard transforms at down_proj's and o_proj's inputs; the same quantizer. Its "
                  "`fuse_layer_norms` subtracts each embedding row's mean for LLaMA too (valid for LayerNorm "
                  "models only): its certificate column is that change of the float logits.", ""]
    return "\n".join(lines)


NOTES = ("Mixtral's experts are stacked 3-d weights: the simulated quantizer rounds their weights and the "
         "experts' input, not their down projection's input (inside their forward). BERT is post-norm: "
         "its residual stream has no rotation (the report gives perm), only the heads' value-output maps "
         "rotate. GPT-2's tied head is untied so the stream rotates (one more vocabulary x width matrix). "
         "Learned: Adam on the W4A8 fake-quantized training loss (straight-through), the start kept "
         "where the learned elements' quantized loss on the training batches is higher.")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["llama", "gpt2", "mixtral", "bert"])
    p.add_argument("--hows", nargs="+", default=["none", "hadamard", "random", "learned"])
    p.add_argument("--learn-steps", type=int, default=30)
    p.add_argument("--train-steps", type=int, default=150, help="AdamW steps of each zoo model (cached)")
    p.add_argument("--out", default="benchmarks/results/rotate")
    p.add_argument("--quarot", metavar="DIR", default=None,
                   help="a checkout of github.com/spcl/QuaRot: its own rotation code on the LLaMA model")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from .rotate_quarot import quarot_commit
    record = {"command": command_line(argv, "benchmarks.bench_rotate"), "commit": commit_info(),
              "threads": torch.get_num_threads(), "group": GROUP, "settings": SETTINGS,
              "train_steps": args.train_steps,
              "quarot": None if not args.quarot else {"commit": quarot_commit(args.quarot)},
              "archs": [run_arch(a, ["none"] + [h for h in args.hows if h != "none"], args.learn_steps,
                                 args.train_steps, args.quarot) for a in args.archs], "notes": NOTES}
    record["seconds"] = time.perf_counter() - t0
    write_result(args.out, ".bench-rotate-", record, markdown, json_name="rotate.json", md_name="rotate.md",
                 command=record["command"])
    print(markdown(record))


if __name__ == "__main__":
    main()

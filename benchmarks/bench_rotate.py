"""Rotations for quantization: briefly trained zoo models of several families, their held-out loss
in float and under simulated quantization, without rotation and rotated by ``symgraph.rotate``
(randomized Hadamard, Haar-random at two seeds, learned), and the share of each setting's loss
gap each rotation closes. Each model also as an ``outliers`` variant of the same function
(:func:`symgraph.rotation.outliers.with_outliers`: a few channels of every foldable norm's gain
×30, its readers' columns ×1/30), the activation outliers trained LLMs have and rotations are for.

Quantizer (``symgraph.testing.quantize``, fake quantization): weights round-to-nearest,
symmetric, in groups of 128 inputs (a row of fewer inputs is one group), the output head kept;
activations per token, symmetric, at every linear layer's input (Mixtral's experts: :data:`NOTES`).
Settings :data:`SETTINGS`.
Gap closed, per setting: ``(L(none) − L(rot)) / (L(none) − L_float)``, given where the gap is
resolved (:func:`gaps`), else the loss change itself.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import symgraph
from symgraph.errors import InputError
from symgraph.rotation.outliers import with_outliers
from symgraph.testing import quantize as Q

from . import evaluate, train
from .provenance import commit_info, command_line, log, table, write_result
from .rotate_quarot import quarot_commit, quarot_rotated

#: ``name: (weight bits, activation bits)``; None: not rounded.
SETTINGS = {"float": (None, None), "W4": (4, None), "W4A8": (4, 8), "W4A4": (4, 4), "W8A8": (8, 8)}
GROUP = 128
EVAL_BATCHES = 4
LEARN_BATCHES = 4
#: The second random rotation (seed 1): its difference to ``random`` (seed 0) is the noise level.
NOISE_ROW = "random@1"
#: A gap closed is a share only where the unrotated gap is at least GAP_MIN nats of loss and
#: NOISE_TIMES × the noise level; below, the table gives the loss change itself.
GAP_MIN = 0.002
NOISE_TIMES = 5
#: The outlier variant: channels per norm, factor.
OUTLIERS = (4, 30.0)
#: The rows by default: fold (the norm gains folded, nothing rotated), hadamard, random, learned;
#: ``NAME@SEED``: another seed than 0.
HOWS = ["none", "fold", "hadamard", "random", NOISE_ROW, "learned"]


def quantized_loss(model, arch, batches, wbits, abits) -> float:
    """Held-out loss of ``model`` with weights rounded to ``wbits`` and linear inputs to ``abits``."""
    m = model if wbits is None else Q.quantize_weights(model, wbits, GROUP)
    with torch.no_grad(), Q.activations(m, abits) if abits is not None else contextlib.nullcontext():
        losses = [float(evaluate.batch_loss(m, arch, b)) for b in batches]
    return sum(losses) / len(losses)


def _rotated(model, arch, how, learn_steps, quarot=None):
    if how == "none":
        return model, {}
    t0 = time.perf_counter()
    if how == "quarot":
        m = quarot_rotated(model, quarot)
        b = evaluate.eval_batches(arch, "eval", max_batches=1)[0]
        with torch.no_grad():  # the largest relative change of the logits on one batch
            x, y = (evaluate.model_logits(n, arch, b).double() for n in (model, m))
        return m, {"certificate": float((x - y).norm() / x.norm()), "seconds": time.perf_counter() - t0,
                   "classes": {"QuaRot's own code": 1}}
    name, _, seed = how.partition("@")
    kw = {"classes": ()} if name == "fold" else {}  # the norm gains folded, nothing rotated
    if name == "learned":
        kw = dict(data=evaluate.eval_batches(arch, "train", max_batches=LEARN_BATCHES), steps=learn_steps, lr=1e-2,
                  weight_bits=4, act_bits=8, group_size=GROUP, loss_fn=lambda m, b: evaluate.batch_loss(m, arch, b))
    res = symgraph.rotate(model, how="hadamard" if name == "fold" else name, seed=int(seed or 0), **kw)
    info = {"certificate": res.error, "untied": res.untied, "seconds": time.perf_counter() - t0,
            "classes": {k: len(v) for k, v in res.roles.items()}}
    if res.learned:
        info["learned"] = {k: v for k, v in res.learned.items() if k != "seconds"}
    return res.model, info


def gaps(rows: dict) -> dict:
    """Per quantized setting: the unrotated model's loss ``gap`` to float, the ``noise`` (the
    two random rotations' difference), whether the gap is ``resolved``, each rotation's share of
    the gap ``closed`` and its loss change ``delta`` to the unrotated model."""
    base = rows["none"]["loss"]
    out = {}
    for s in list(SETTINGS)[1:]:
        gap = base[s] - base["float"]
        noise = abs(rows[NOISE_ROW]["loss"][s] - rows["random"]["loss"][s]) if NOISE_ROW in rows else None
        out[s] = {"gap": gap, "noise": noise, "resolved": gap >= max(GAP_MIN, NOISE_TIMES * (noise or 0.0)),
                  "closed": {h: (base[s] - r["loss"][s]) / gap if gap > 0 else None
                             for h, r in rows.items() if h != "none"},
                  "delta": {h: r["loss"][s] - base[s] for h, r in rows.items() if h != "none"}}
    return out


def run_rows(model, arch, hows, learn_steps, quarot=None, label=None) -> dict:
    """``{"rows": {how: {"loss": {setting: loss}, ...}}, "gaps": ...}`` of ``model`` rotated each
    way of ``hows`` (and by QuaRot's code, for the LLaMA model, given a ``quarot`` checkout)."""
    batches = evaluate.eval_batches(arch, "eval", max_batches=EVAL_BATCHES)
    rows = {}
    for how in list(hows) + (["quarot"] if quarot and arch == "llama" else []):
        log(f"bench_rotate: {label or arch} {how}")
        m, info = _rotated(model, arch, how, learn_steps, quarot)
        rows[how] = {"loss": {name: quantized_loss(m, arch, batches, w, a) for name, (w, a) in SETTINGS.items()},
                     **info}
    return {"rows": rows, "gaps": gaps(rows)}


def run_arch(arch: str, hows, learn_steps: int, train_steps: int, quarot=None) -> dict:
    """Losses of ``arch`` (trained ``train_steps`` steps, seed 0, quick size) per rotation and
    setting, for the trained model (``plain``) and its ``outliers`` variant."""
    model = train.train_model(arch, seed=0, size="quick", steps=train_steps)
    out = {"arch": arch, "variants": {"plain": run_rows(model, arch, hows, learn_steps, quarot, f"{arch} plain")}}
    try:
        o = with_outliers(model, channels=OUTLIERS[0], factor=OUTLIERS[1], seed=0)
    except InputError as e:  # no foldable norm (post-norm BERT): nothing to put outliers on
        out["variants"]["outliers"] = {"skipped": str(e)}
        return out
    out["variants"]["outliers"] = {"channels": o.channels, "norms": len(o.norms), "untied": o.untied,
                                   "certificate": o.error,
                                   **run_rows(o.model, arch, hows, learn_steps, quarot, f"{arch} outliers")}
    return out


def _share(g, how) -> str:
    """A gap table's cell: the share closed where the gap is resolved, else the loss change."""
    if g["closed"].get(how) is None:
        return "-"
    return f"{100 * g['closed'][how]:.0f}%" if g["resolved"] else f"Δ{g['delta'][how]:+.4f}"


def tables(record, gap_note: str) -> list:
    """The losses table and the section on the share of the gap closed (``gap_note`` its
    explanation), as Markdown lines: this benchmark's and ``bench_rotate_stream``'s."""
    rows, gap_rows = [], []
    hows = list(dict.fromkeys(h for r in record["archs"] for v in r["variants"].values()
                              for h in v.get("rows", {}) if h != "none"))
    for r in record["archs"]:
        for variant, v in r["variants"].items():
            if "skipped" in v:
                rows.append([r["arch"], variant, "(none: no foldable norm)", *["-"] * (len(SETTINGS) + 2)])
            for how, row in v.get("rows", {}).items():
                rows.append([r["arch"], variant, how, *(f"{row['loss'][s]:.4f}" for s in SETTINGS),
                             f"{row['certificate']:.1e}" if "certificate" in row else "-",
                             ", ".join(f"{k} {n}" for k, n in row.get("classes", {}).items()) or "-"])
            for s, g in v.get("gaps", {}).items():
                gap_rows.append([r["arch"], variant, s, f"{g['gap']:.4f}",
                                 "-" if g["noise"] is None else f"{g['noise']:.4f}", *(_share(g, h) for h in hows)])
    header = ["model", "variant", "rotation", *SETTINGS, "certificate", "classes"]
    lines = table(header, rows, ["l", "l", "l", *["r"] * (len(header) - 3)])
    lines += ["", "## Share of the loss gap closed", "", gap_note, ""]
    header = ["model", "variant", "setting", "gap", "noise", *hows]
    return lines + table(header, gap_rows, ["l", "l", "l", *["r"] * (len(header) - 3)])


def header(title: str, record) -> list:
    """A rotate report's first lines: its title, command and commit."""
    return [f"# {title}", "", f"Command: `{record['command']}`  ",
            f"Commit: `{record['commit']['commit']}` (tracked files differ: {record['commit']['dirty']})", ""]


def markdown(record) -> str:
    lines = header("Rotations for quantization (issue 64)", record) + [
        f"Held-out loss (quick zoo models, seed 0, {record['train_steps']} training steps; first "
        f"{EVAL_BATCHES} evaluation batches). Weights RTN symmetric, groups of {GROUP} inputs (a row of "
        "fewer inputs: one group), head kept; activations per token at every linear input. "
        f"Variants: `plain`, the trained model; `outliers`, the same function with {OUTLIERS[0]} channels of "
        f"every foldable norm's gain (and shift) ×{OUTLIERS[1]:g} and the matching input columns of that "
        f"norm's readers ×1/{OUTLIERS[1]:g} (`symgraph.rotation.outliers.with_outliers`; the readers' "
        "inputs get outlier channels, as trained LLMs have). Rows: `fold`, the norm gains folded into "
        "their readers and nothing rotated (what `symgraph rotate` does before it rotates); `random` seed 0, "
        "`random@1` seed 1 (the noise level), `hadamard` and `learned` seed 0.", ""]
    lines += tables(record, "Gap: the unrotated model's loss minus the float loss, per setting. Noise: "
                    "|random − random@1|, two rotation seeds of one model. A rotation's share of the gap closed, "
                    f"`(L_none − L_rot) / gap`, is given where the gap is at least {GAP_MIN} nats and "
                    f"{NOISE_TIMES}× the noise; below that the gap is not resolved and the cell gives the loss "
                    "change `Δ = L_rot − L_none` (negative: better).")
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
         "rotate, and no norm folds, so it has no outlier variant (its norms' outputs are the stream itself). "
         "GPT-2's tied head is untied so the stream rotates (one more vocabulary x width matrix); its outlier "
         "variant is untied too, so the final norm gets outliers. "
         "The outlier variant is the plain model in another gauge of its norms: folding the gains into the "
         "readers gives back the plain model's folded weights, so its `fold` row equals the plain model's and "
         "removes these outliers without any rotation; a rotation's own effect is its difference to `fold`. "
         "Learned: Adam on the W4A8 fake-quantized training loss (straight-through), the start kept "
         "where the learned elements' quantized loss on the training batches is higher.")


def arguments(p: argparse.ArgumentParser, archs, out: str) -> None:
    """The arguments this benchmark and ``bench_rotate_stream`` share."""
    p.add_argument("--archs", nargs="+", default=archs)
    p.add_argument("--hows", nargs="+", default=HOWS, help="rows: " + ", ".join(HOWS) + "; NAME@SEED: another seed")
    p.add_argument("--learn-steps", type=int, default=30)
    p.add_argument("--train-steps", type=int, default=150, help="AdamW steps of each zoo model (cached)")
    p.add_argument("--out", default=out)
    p.add_argument("--quarot", metavar="DIR", default=None,
                   help="a checkout of github.com/spcl/QuaRot: its own rotation code on the LLaMA model")


def run_and_write(args, argv, module: str, name: str, record: dict, run_arch, markdown, notes: str | None = None) -> None:
    """Runs ``run_arch(arch, hows)`` for every arch into ``record`` (with the command, commit and
    settings), writes ``NAME.json`` and ``NAME.md`` into ``args.out`` and prints the report."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hows = ["none"] + [h for h in args.hows if h != "none"]
    record = {"command": command_line(argv, module), "commit": commit_info(), "threads": torch.get_num_threads(),
              **record, "quarot": None if not args.quarot else {"commit": quarot_commit(args.quarot)},
              "archs": [run_arch(a, hows) for a in args.archs]}
    if notes is not None:
        record["notes"] = notes
    record["seconds"] = time.perf_counter() - t0
    write_result(args.out, f".bench-{name.replace('_', '-')}-", record, markdown, json_name=f"{name}.json",
                 md_name=f"{name}.md", command=record["command"])
    print(markdown(record))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments(p, ["llama", "gpt2", "mixtral", "bert"], "benchmarks/results/rotate")
    args = p.parse_args(argv)
    record = {"group": GROUP, "settings": SETTINGS, "train_steps": args.train_steps,
              "outliers": {"channels": OUTLIERS[0], "factor": OUTLIERS[1]}}
    run_and_write(args, argv, "benchmarks.bench_rotate", "rotate", record,
          lambda a, hows: run_arch(a, hows, args.learn_steps, args.train_steps, args.quarot), markdown, NOTES)


if __name__ == "__main__":
    main()

"""Benchmark: BatchNorm CNN pairs on the digits (Git Re-Basin's and REPAIR's setting): vanilla,
weight matching and activation matching, each with and without REPAIR.

:class:`DigitsCNN` (widths :data:`WIDTHS`) is trained per seed with the zoo's recipe
(:func:`benchmarks.train.fit`; the seed fixes initialisation and data order) and cached under
``$SYMGRAPH_CACHE/models/cnn-...``. For each seed pair (A, B), B' is B (``vanilla``) or B aligned
to A by ``symgraph.align`` from weights or from activations on the training split; the curve
``λθ_A + (1−λ)θ_B'`` (21 points, λ=1 is A) interpolates the parameters *and* the BatchNorm
running statistics. ``+repair``: at every λ the BatchNorm statistics are reset on the training
split (``symgraph.merge([A, B'], weights=[λ, 1−λ], align=None, repair=True)``); each repaired
midpoint is also ``symgraph.merge([A, B], align=..., repair=True)``'s own (``merge_loss_mid``).

Numbers, on the whole held-out split: cross-entropy and accuracy along each curve; ``barrier``:
``max_λ L(λ) − ½(L_A + L_B)`` with the parents' own losses; ``barrier_curve``: with the curve's
endpoints (``symgraph.loss_barrier``); ``acc_drop``: ``½(acc_A + acc_B) − min_λ acc(λ)``.

``python -m benchmarks.bench_cnn [--size quick] [--seeds 0 1 2] [--out DIR]`` writes
``results.json``, ``report.md`` and ``cnn_curves.png`` (default ``benchmarks/results/cnn``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph

from . import data as D
from . import evaluate as ev
from . import train, zoo
from .provenance import (REPO_ROOT, git_state, log, markdown_table, mean_sd, mean_sd_cell, pyplot,
                         save_figure, write_result)

WIDTHS = {"quick": (16, 32, 32), "full": (32, 64, 64)}
STEPS = {"quick": 400, "full": 1500}
BATCH_SIZE = 64
LR = 3e-3
#: Images per batch of the reset / activation-alignment data (the whole training split).
DATA_BATCH = 256
ALIGNS = {"vanilla": None, "weights": "weights", "activations": "activations"}
METHOD_ORDER = ("vanilla", "vanilla+repair", "weights", "weights+repair", "activations", "activations+repair")
LAMBDAS = np.linspace(0.0, 1.0, 21).round(4)


class DigitsCNN(nn.Module):
    """conv-BN-ReLU, conv-BN-ReLU-maxpool, conv-BN-ReLU-maxpool, linear; 1×8×8 → 10 logits."""

    def __init__(self, widths=WIDTHS["quick"]):
        super().__init__()
        w1, w2, w3 = self.widths = tuple(int(w) for w in widths)
        self.conv1, self.bn1 = nn.Conv2d(1, w1, 3, padding=1), nn.BatchNorm2d(w1)
        self.conv2, self.bn2 = nn.Conv2d(w1, w2, 3, padding=1), nn.BatchNorm2d(w2)
        self.conv3, self.bn3 = nn.Conv2d(w2, w3, 3, padding=1), nn.BatchNorm2d(w3)
        self.fc = nn.Linear(w3 * 2 * 2, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)
        return self.fc(x.flatten(1))

    def save_pretrained(self, path, safe_serialization=True):
        """``model.safetensors`` and ``config.json`` (the widths), as :func:`train.save_atomically` asks."""
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(Path(path) / "model.safetensors"))
        (Path(path) / "config.json").write_text(json.dumps({"widths": list(self.widths)}))

    @classmethod
    def from_pretrained(cls, path):
        from safetensors.torch import load_file
        m = cls(json.loads((Path(path) / "config.json").read_text())["widths"])
        m.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
        return m.eval()


def train_cnn(seed: int, size: str = "quick", steps: int | None = None) -> tuple:
    """``(model, training info)``: :class:`DigitsCNN` trained from ``seed``, from the cache when there."""
    steps = STEPS[size] if steps is None else int(steps)
    payload = {"version": train.CACHE_VERSION, "widths": WIDTHS[size], "batch_size": BATCH_SIZE,
               "lr": LR, "data": D.data_fingerprint("digits"), "optim": train.OPTIM}
    fp = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]
    path = D.cache_dir() / "models" / f"cnn-{size}-seed{seed}-steps{steps}-{fp}"
    if (path / "training_info.json").is_file():
        return DigitsCNN.from_pretrained(path), json.loads((path / "training_info.json").read_text())
    sample = train.batch_sampler(zoo.get_spec("vit"), BATCH_SIZE,  # the training digits
                                 torch.Generator().manual_seed(seed + train.DATA_SEED_OFFSET))
    torch.manual_seed(seed)
    model = DigitsCNN(WIDTHS[size])
    t = time.perf_counter()
    losses = train.fit(model, sample, steps, LR, threads=train.num_threads(),
                       loss_fn=lambda m, b: F.cross_entropy(m(b["pixel_values"]), b["labels"]))
    loss, acc = evaluate(model, _eval_batches())
    tail = losses[-max(1, steps // 10):]
    info = {"arch": "cnn", "size": size, "seed": seed, "steps": steps, "widths": list(WIDTHS[size]),
            "train_seconds": time.perf_counter() - t, "eval_loss": loss, "eval_accuracy": acc,
            "final_train_loss": sum(tail) / len(tail), "num_threads": train.num_threads(),
            "num_parameters": sum(p.numel() for p in model.parameters())}
    train.save_atomically(model, info, path)
    return model, info


def _eval_batches():
    """The held-out digits in order, in the suite's evaluation batches."""
    return [(b["pixel_values"], b["labels"]) for b in ev.eval_batches("vit")]


def evaluate(model, batches) -> tuple:
    """(mean cross-entropy, accuracy) of ``model`` (eval mode, no grad) over ``batches``."""
    was = model.training
    model.eval()
    total, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = model(x)
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += len(y)
    model.train(was)
    return total / n, correct / n


def interpolated(a, b, lam):
    """``λθ_A + (1−λ)θ_B``: parameters and floating buffers (running statistics); the rest
    (``num_batches_tracked``) A's."""
    m = copy.deepcopy(a)
    sb = b.state_dict()
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if v.is_floating_point():
                v.copy_(lam * v + (1 - lam) * sb[k])
    return m


def _curve(a, b, batches, data, repair: bool):
    out = []
    for lam in map(float, LAMBDAS):
        if repair:  # the interpolated model, its BatchNorm statistics reset on the data
            m = symgraph.merge([a, b], weights=[lam, 1 - lam], align=None, data=data, repair=True).model
        else:
            m = interpolated(a, b, lam)
        out.append((lam, *evaluate(m, batches)))
    return out


def run(size: str = "quick", seeds=(0, 1, 2), pairs: int | None = None, steps: int | None = None,
        *, reset_images: int | None = None, verbose: bool = True) -> dict:
    """Every method on every seed pair (the first ``pairs``; None: all) of :class:`DigitsCNN`s
    trained per seed, BatchNorm statistics reset on the first ``reset_images`` training images
    (None: all); ``{"settings", "models", "records"}``, a record per (pair, method, repair)."""
    t_start = time.perf_counter()
    seeds = tuple(seeds)
    trained = {s: train_cnn(s, size, steps) for s in seeds}
    batches = _eval_batches()
    x = D.digits("train")[0][:reset_images]
    data = [(x[i:i + DATA_BATCH],) for i in range(0, len(x), DATA_BATCH)]
    ends = {s: evaluate(m, batches) for s, (m, _) in trained.items()}
    if verbose:
        log("cnn: " + ", ".join(f"seed {s} loss {l:.4f} acc {a:.4f}" for s, (l, a) in ends.items()))
    records = []
    for sa, sb in list(itertools.combinations(seeds, 2))[:pairs]:
        A, B = trained[sa][0], trained[sb][0]
        (la, aa), (lb, ab) = ends[sa], ends[sb]
        ref = symgraph.analyze(A, data[0])
        for method, align in ALIGNS.items():
            t = time.perf_counter()
            Bp = B if align is None else symgraph.align(
                A, B, data[0], data=data if align == "activations" else None, report_a=ref).apply(B)
            align_s = time.perf_counter() - t
            lb_aligned = evaluate(Bp, batches)[0]
            for repair in (False, True):
                t = time.perf_counter()
                curve = _curve(A, Bp, batches, data, repair)
                losses, accs = [c[1] for c in curve], [c[2] for c in curve]
                rec = {"pair": [sa, sb], "method": method + ("+repair" if repair else ""),
                       "align": align, "repair": repair, "size": size,
                       "loss_a": la, "loss_b": lb, "acc_a": aa, "acc_b": ab, "loss_b_aligned": lb_aligned,
                       "curve": [[lam, l] for lam, l, _ in curve], "acc_curve": [[lam, a] for lam, _, a in curve],
                       "barrier": max(losses) - 0.5 * (la + lb),
                       "barrier_curve": symgraph.loss_barrier([(lam, l) for lam, l, _ in curve]),
                       "acc_drop": 0.5 * (aa + ab) - min(accs), "loss_mid": losses[10], "acc_mid": accs[10],
                       "align_seconds": align_s, "curve_seconds": time.perf_counter() - t}
                if repair:  # the library's own repaired midpoint
                    t = time.perf_counter()
                    res = symgraph.merge([A, B], data=data, align=align, repair=True)
                    rec["merge_loss_mid"], rec["merge_acc_mid"] = evaluate(res.model, batches)
                    rec["merge_seconds"] = time.perf_counter() - t
                    rec["batchnorm"] = [dataclasses.asdict(b) for b in res.repair.batchnorm]
                    rec["repair_seconds"] = res.repair.seconds
                records.append(rec)
                if verbose:
                    log(f"  cnn {sa}-{sb} {rec['method']:<20} barrier {rec['barrier']:7.4f}  "
                        f"L(0.5) {rec['loss_mid']:.4f}  acc(0.5) {rec['acc_mid']:.4f}")
    return {"settings": {"size": size, "seeds": list(seeds), "pairs": pairs,
                         "steps": STEPS[size] if steps is None else steps,
                         "widths": list(WIDTHS[size]), "batch_size": BATCH_SIZE, "lr": LR,
                         "reset_images": len(x), "eval_images": sum(len(b[1]) for b in batches),
                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "symgraph_commit": git_state(), "wall_seconds": time.perf_counter() - t_start},
            "models": {str(s): {"loss": ends[s][0], "accuracy": ends[s][1], **info}
                       for s, (_, info) in trained.items()},
            "records": records}


def markdown(res) -> str:
    """``report.md``: the parents, per method the barrier, midpoint loss / accuracy and accuracy
    drop (mean ± sd over the pairs), then every pair."""
    st, recs = res["settings"], res["records"]
    pairs = list(dict.fromkeys(tuple(r["pair"]) for r in recs))
    lines = ["# CNN with BatchNorm on digits: alignment and REPAIR", "",
             f"{len(st['seeds'])} VGG-style CNNs (conv {'/'.join(map(str, st['widths']))}, each "
             f"conv → BatchNorm → ReLU; `benchmarks/bench_cnn.py`) trained {st['steps']} steps "
             "on the digits, seed = init and data order. For each of the "
             f"{len(pairs)} seed pairs: the curve `λθ_A + (1−λ)θ_B'` (21 points; parameters and "
             "BatchNorm running statistics interpolated) on the "
             f"{st['eval_images']} held-out images, B' = B (`vanilla`), B aligned by weight "
             "matching (`weights`) or activation matching (`activations`); `+repair`: every "
             "point's BatchNorm statistics reset on the "
             f"{st['reset_images']} training images (`symgraph.merge(..., repair=True)`). "
             "Barrier `max_λ L(λ) − ½(L_A + L_B)` (cross-entropy, nats), accuracy drop "
             "`½(acc_A + acc_B) − min_λ acc(λ)`; mean ± sd over pairs.", "",
             "![curves](cnn_curves.png)", "",
             markdown_table(["seed", "loss", "accuracy", "train s"],
                            [[s, f"{m['loss']:.4f}", f"{m['accuracy']:.4f}", f"{m['train_seconds']:.1f}"]
                             for s, m in res["models"].items()])]
    rows = []
    for m in METHOD_ORDER:
        rs = [r for r in recs if r["method"] == m]
        stat = lambda k: mean_sd_cell(mean_sd([r[k] for r in rs]), 4)  # noqa: E731
        if rs:
            rows.append([m, stat("barrier"), stat("loss_mid"), stat("acc_mid"), stat("acc_drop"),
                         stat("merge_loss_mid") if "merge_loss_mid" in rs[0] else "—"])
    lines += ["", markdown_table(["method", "barrier", "L(0.5)", "acc(0.5)", "acc drop", "L(merge, repair=True)"],
                                 rows), ""]
    by = {(tuple(r["pair"]), r["method"]): r for r in recs}
    rows = [[f"{a}-{b}"] + [f"{by[(a, b), m]['barrier']:.4f} / {by[(a, b), m]['acc_mid']:.4f}"
                            if ((a, b), m) in by else "—" for m in METHOD_ORDER] for a, b in pairs]
    lines += ["Per pair: barrier / accuracy at λ = 0.5.", "", markdown_table(["pair", *METHOD_ORDER], rows), ""]
    return "\n".join(lines)


def plot(res, out_dir) -> list:
    """``cnn_curves.png``: loss and accuracy along λ for the first pair, a colour per alignment,
    dashed without REPAIR, solid with; the file names written."""
    recs = res["records"]
    if not recs:
        return []
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.4))
    colours = {"vanilla": "tab:gray", "weights": "tab:blue", "activations": "tab:red"}
    pair = recs[0]["pair"]
    for r in (r for r in recs if r["pair"] == pair):
        style = dict(color=colours[r["method"].split("+")[0]], ls="-" if r["repair"] else "--",
                     label=r["method"].replace("+repair", " + REPAIR"))
        for ax, key in zip(axes, ("curve", "acc_curve")):
            ax.plot([x for x, _ in r[key]], [y for _, y in r[key]], **style)
    axes[0].set_ylabel("held-out loss")
    axes[1].set_ylabel("held-out accuracy")
    for ax in axes:
        ax.set_xlabel("λ  (0: B', 1: A)")
    axes[0].set_title(f"CNN + BatchNorm, seeds {pair[0]} and {pair[1]}")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [save_figure(fig, Path(out_dir) / "cnn_curves.png", bbox_inches="tight")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cnn", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="quick", choices=tuple(WIDTHS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pairs", type=int, default=None, help="seed pairs (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: STEPS)")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "cnn"))
    a = ap.parse_args(argv)
    torch.set_num_threads(train.num_threads())
    res = run(a.size, a.seeds, a.pairs, a.steps)
    print(markdown(res))
    write_result(a.out, ".cnn-", res, markdown, plot)


if __name__ == "__main__":
    main()

"""Benchmark: the provenance verdict's threshold, calibrated on trained independent pairs.

``symgraph compare`` calls B "derived" from A when the excess of its median correlation after
alignment over a shuffled null (:mod:`symgraph.alignment.compare`) reaches a threshold. The
shuffled null keeps none of B's structure, so models trained on the same text from different
seeds already stand above it: by how much? Three families of :mod:`symgraph.testing.models`
(LLaMA, Qwen2, GPT-NeoX), each trained ``--seeds`` times from its own initialisation and data
order on the repository's prose (:mod:`benchmarks.data`, AdamW with :mod:`benchmarks.train`'s
settings). Null: every independent pair of one family. Positives, for the first ``--bases``
models: continued training on the same text (another data order), a short and a long fine-tune
on another corpus (the standard library's code; :data:`KINDS`), and a permuted exact copy (which
must be "same"). Every B is moved by a random element of the full groups, then compared with
``compare``'s default null (4 shuffled copies).

The threshold rule (:func:`choose_threshold`): the midpoint of the highest independent and the
lowest derived excess (permuted copies aside), to two decimals.

``python -m benchmarks provenance_calibration [--seeds 5] [--bases 2] [--steps 600] [--out DIR]``
regenerates ``benchmarks/results/provenance_calibration/`` (report.md, results.json, excess.png):
about 10 minutes on one thread.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

import symgraph
from symgraph.alignment.compare import ALPHA, THRESHOLD
from symgraph.testing import models

from . import data
from .bench_provenance import compared
from .provenance import git_state, log, pyplot, save_figure, table, write_result
from .train import DATA_SEED_OFFSET, fit

FAMILIES = ("llama", "qwen2", "neox")
#: The derived kinds: (name, corpus, steps as a multiple of the parents', peak rate).
KINDS = (("continued", "prose", 0.5, 1e-3), ("finetune", "code", 0.5, 1e-3), ("finetune_long", "code", 4, 3e-3))
SIZES = dict(vocab=data.VOCAB_SIZE, hidden=32, layers=2, heads=4, mlp=64, positions=64)
BLOCK, BATCH, LR = 32, 16, 3e-3
OUT = Path(__file__).parent / "results" / "provenance_calibration"


def build(family: str, seed: int) -> torch.nn.Module:
    """Family ``family``'s model at :data:`SIZES`, initialised from ``seed``."""
    if family in models.ARCHS:
        extra = {"kv_heads": 2} if family == "llama" else {}
        return models.build(family, seed=seed, **SIZES, **extra)
    if family != "qwen2":
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    cfg = tf.Qwen2Config(vocab_size=SIZES["vocab"], hidden_size=SIZES["hidden"], num_hidden_layers=SIZES["layers"],
                         num_attention_heads=SIZES["heads"], num_key_value_heads=2, intermediate_size=SIZES["mlp"],
                         max_position_embeddings=SIZES["positions"], use_cache=False, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return tf.Qwen2ForCausalLM(cfg).eval()


def train(model, corpus: str, seed: int, steps: int, lr: float) -> float:
    """Train ``model`` in place on ``corpus``'s train split (data order from ``seed``); return its
    held-out loss (the first 8 evaluation blocks)."""
    gen = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)

    def sample():
        ids = data.random_blocks(corpus, "train", BLOCK, BATCH, gen)
        return {"input_ids": ids, "labels": ids}
    fit(model, sample, steps, lr)
    ids = data.token_blocks(corpus, "eval", BLOCK)[:8]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def derived(parent, seed: int, steps: int) -> list:
    """``[(kind, model, held-out loss on its corpus)]``: the parent's derived copies (:data:`KINDS`),
    then the parent itself (the permuted exact copy, once moved)."""
    out = []
    for k, (kind, corpus, mult, lr) in enumerate(KINDS):
        m = copy.deepcopy(parent)
        out.append((kind, m, train(m, corpus, 7919 * (k + 1) + seed, max(1, round(mult * steps)), lr)))
    return out + [("permuted", parent, None)]


def choose_threshold(null, positive) -> tuple[float, str]:
    """The threshold and its rule: the midpoint of the highest independent and the lowest derived
    excess, to two decimals; the highest independent excess + 0.01 where the two overlap."""
    hi, lo = max(null), min(positive)
    if lo > hi:
        return round(0.5 * (hi + lo), 2), "midpoint of the highest independent and the lowest derived excess"
    return round(hi + 0.01, 2), "the highest independent excess + 0.01 (independent and derived overlap)"


def derived_at(row, threshold: float) -> bool:
    """Whether ``row`` would be called derived (or same) at ``threshold`` (the rule of ``judge``)."""
    p = row["p_value"]
    return row["verdict"] == "same" or (row["excess"] >= threshold and p is not None and p < ALPHA)


def rates(rows, threshold: float) -> dict:
    """False- and true-positive rates of the verdict at ``threshold`` (per kind too)."""
    neg = [derived_at(r, threshold) for r in rows if r["kind"] == "independent"]
    pos = [(r["kind"], derived_at(r, threshold)) for r in rows if r["kind"] != "independent"]
    hits = [d for _, d in pos]
    return {"threshold": threshold, "false_positives": sum(neg), "negatives": len(neg),
            "fpr": sum(neg) / max(len(neg), 1), "true_positives": sum(hits), "positives": len(pos),
            "tpr": float(np.mean(hits)) if pos else float("nan"),
            "tpr_by_kind": {k: float(np.mean([d for j, d in pos if j == k])) for k in sorted({k for k, _ in pos})}}


def compare_row(A, B, report, kind: str, family: str, a: int, b, n: int) -> dict:
    """B moved by a random full-group element, then compared with A as ``compare`` does by default."""
    row, res = compared(A, symgraph.transform(B, report.random_transform(seed=1000 + n)), seed=n)
    log(f"{family} {kind} {a}-{b}: {res.verdict}, excess {res.excess:.3f}, p {res.p_value}")
    return {"family": family, "kind": kind, "a": a, "b": b, **row}


def _family(family: str, seeds: int, bases: int, steps: int, n0: int) -> tuple[list, dict]:
    """One family's rows (independent pairs, then derived copies) and its training numbers."""
    t0 = time.perf_counter()
    parents, losses = [], []
    for s in range(seeds):
        m = build(family, s)
        losses.append(train(m, "prose", s, steps, LR))
        parents.append(m)
    kids = {i: derived(parents[i], i, steps) for i in range(min(bases, seeds))}
    t_train = time.perf_counter() - t0
    report = symgraph.analyze(parents[0])
    rows = [compare_row(parents[i], parents[j], report, "independent", family, i, j, n0 + n)
            for n, (i, j) in enumerate(itertools.combinations(range(seeds), 2))]
    for i, copies in kids.items():
        for kind, m, _ in copies:
            rows.append(compare_row(parents[i], m, report, kind, family, i, kind, n0 + len(rows)))
    info = {"held_out_loss": losses, "derived_loss": {f"{i}:{k}": x for i, c in kids.items() for k, _, x in c
                                                      if x is not None},
            "unigram_loss": _unigram_loss(), "seconds_train": t_train,
            "seconds_compare": time.perf_counter() - t0 - t_train}
    return rows, info


def _unigram_loss() -> float:
    """The held-out loss of the train split's unigram distribution: what training must beat."""
    ids = data.token_ids("prose", "train")
    p = torch.bincount(ids, minlength=data.VOCAB_SIZE).double() + 1
    p /= p.sum()
    ev = data.token_blocks("prose", "eval", BLOCK)[:8].reshape(-1)
    return float(-p[ev].log().mean())


def _distribution(x) -> dict:
    x = np.asarray(x, dtype=float)
    return {"n": int(x.size), "min": float(x.min()), "median": float(np.median(x)), "mean": float(x.mean()),
            "sd": float(x.std(ddof=1)) if x.size > 1 else 0.0, "max": float(x.max())}


def run(families, seeds: int, bases: int, steps: int) -> dict:
    """Every family's rows, the null's and positives' distributions, the chosen threshold and the
    rates at the library's threshold and at the chosen one."""
    t0, commit = time.perf_counter(), git_state()  # the commit the run starts from (HEAD may move on)
    rows, info = [], {}
    for f in families:
        got, info[f] = _family(f, seeds, bases, steps, len(rows))
        rows += got
    null = [r["excess"] for r in rows if r["kind"] == "independent"]
    pos = [r["excess"] for r in rows if r["kind"] not in ("independent", "permuted")]
    chosen, rule = choose_threshold(null, pos) if pos else (None, "none: no derived pairs in this run")
    kinds = sorted({r["kind"] for r in rows})
    return {"commit": commit, "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "families": list(families),
            "sizes": SIZES, "seeds": seeds, "bases": bases, "steps": steps, "lr": LR, "block": BLOCK,
            "batch": BATCH, "kinds": {k: {"corpus": c, "steps": max(1, round(m * steps)), "lr": lr}
                                      for k, c, m, lr in KINDS},
            "library_threshold": THRESHOLD, "alpha": ALPHA, "chosen_threshold": chosen, "rule": rule,
            "excess": {k: _distribution([r["excess"] for r in rows if r["kind"] == k]) for k in kinds},
            "null_by_family": {f: _distribution([r["excess"] for r in rows if r["kind"] == "independent"
                                                 and r["family"] == f]) for f in families},
            "at_library": rates(rows, THRESHOLD),
            "at_chosen": rates(rows, chosen) if chosen is not None else None,
            "sweep": [rates(rows, t) for t in (0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)],
            "training": info, "rows": rows, "seconds": time.perf_counter() - t0}


def _rate_line(r: dict) -> str:
    kinds = ", ".join(f"{k} {x:.2f}" for k, x in r["tpr_by_kind"].items())
    return (f"false-positive rate {r['fpr']:.3f} ({r['false_positives']}/{r['negatives']}), true-positive rate "
            f"{r['tpr']:.3f} ({r['true_positives']}/{r['positives']}: {kinds})")


def markdown(r) -> str:
    lib, ch, k = r["at_library"], r["at_chosen"], r["kinds"]
    lines = [f"# Provenance calibration: the excess of trained independent pairs (commit {r['commit']}, {r['when']})",
             "", f"{r['seeds']} models per family ({', '.join(r['families'])}; sizes {r['sizes']}) trained "
             f"{r['steps']} steps (AdamW, peak rate {r['lr']}, warm-up cosine, batches of {r['batch']}×{r['block']} "
             "tokens) on the repository's prose from their own initialisation and data order; null: every "
             f"independent pair of a family ({lib['negatives']}). Positives, for the first {r['bases']} models of "
             "each family: " + ", ".join(f"{n} ({v['corpus']}, {v['steps']} steps at {v['lr']:g})"
                                        for n, v in k.items())
             + ", and a permuted exact copy; every B moved by a random element of the full groups, then "
             f"`symgraph.compare(A, B)` with its default null (4 shuffled copies), alpha {r['alpha']:g}.", "",
             f"**At the library's threshold ({r['library_threshold']:g})**: {_rate_line(lib)}.", "",
             (f"**Chosen threshold {r['chosen_threshold']:g}** (rule: {r['rule']}): {_rate_line(ch)}." if ch else
              "No derived pairs in this run (`--bases 0`): no threshold chosen."), "",
             "Excess by kind:", ""]
    lines += table(["pairs", "n", "min", "median", "mean", "sd", "max"],
                   [[n, d["n"], *(f"{d[x]:.3f}" for x in ("min", "median", "mean", "sd", "max"))]
                    for n, d in r["excess"].items()], ["l", "r", "r", "r", "r", "r", "r"])
    lines += ["", "Independent pairs by family:", ""]
    lines += table(["family", "n", "min", "median", "max", "held-out loss (unigram "
                    f"{next(iter(r['training'].values()))['unigram_loss']:.2f})", "seconds (train / compare)"],
                   [[f, d["n"], f"{d['min']:.3f}", f"{d['median']:.3f}", f"{d['max']:.3f}",
                     " ".join(f"{x:.2f}" for x in r["training"][f]["held_out_loss"]),
                     f"{r['training'][f]['seconds_train']:.0f} / {r['training'][f]['seconds_compare']:.0f}"]
                    for f, d in r["null_by_family"].items()])
    lines += ["", "The verdict at other thresholds:", ""]
    lines += table(["threshold", "false positives", "FPR", "TPR"],
                   [[f"{s['threshold']:g}", f"{s['false_positives']}/{s['negatives']}", f"{s['fpr']:.3f}",
                     f"{s['tpr']:.3f}"] for s in r["sweep"]], ["r", "r", "r", "r"])
    lines += ["", f"Runtime: {r['seconds']:.0f} s, {r['threads']} thread(s).", ""]
    return "\n".join(lines)


def plot(r, out) -> None:
    """``excess.png``: each pair's excess by kind (independent grey, derived red), the library's
    and the chosen threshold."""
    plt = pyplot()
    kinds = ["independent", *r["kinds"], "permuted"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    marks = {f: m for f, m in zip(r["families"], "os^v")}
    for x, k in enumerate(kinds):
        for j, f in enumerate(r["families"]):
            ys = [row["excess"] for row in r["rows"] if row["kind"] == k and row["family"] == f]
            ax.scatter([x + 0.15 * (j - 1)] * len(ys), ys, s=14, marker=marks[f],
                       color="tab:gray" if k == "independent" else "tab:red", label=f if x == 0 else None)
    ax.axhline(r["library_threshold"], ls=":", lw=0.9, color="k", label=f"threshold {r['library_threshold']:g}")
    if r["chosen_threshold"] not in (None, r["library_threshold"]):
        ax.axhline(r["chosen_threshold"], ls="--", lw=0.9, color="tab:blue",
                   label=f"chosen {r['chosen_threshold']:g}")
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels(kinds, fontsize=8)
    ax.set_ylabel("excess over the shuffled null")
    ax.set_title("compare on trained pairs: independent (grey) and derived (red)", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_figure(fig, Path(out) / "excess.png", 120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks provenance_calibration",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--seeds", type=int, default=5, help="independently trained models per family (null: all pairs)")
    ap.add_argument("--bases", type=int, default=2, help="models per family that get derived copies")
    ap.add_argument("--steps", type=int, default=600, help="training steps of each model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    fams = a.families.split(",")
    if set(fams) - set(FAMILIES) or a.seeds < 2 or a.steps < 1 or a.bases < 0:
        ap.error(f"expected --families of {', '.join(FAMILIES)}, --seeds >= 2, --steps >= 1, --bases >= 0")
    torch.set_num_threads(a.threads)
    res = run(fams, a.seeds, a.bases, a.steps)
    write_result(a.out, ".calibration-", res, markdown, plot)
    print(markdown(res))
    return 0

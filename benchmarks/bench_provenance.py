"""Benchmark: ``symgraph.compare``'s provenance verdict, calibrated without downloads.

Tiny LLaMAs (:func:`symgraph.testing.models.build`) trained briefly from different seeds on a
synthetic language (``x -> 3x + 1 mod V``, 20% noise). Null: every pair of independently trained
models. Positives, for ``--bases`` of them: a fine-tune (``--finetune-steps`` on ``x -> 5x + 2``),
a long one (``--long-steps`` at a higher rate), a 50% magnitude-pruned copy, an int8 round trip
(per-tensor symmetric) and a merge (the average with an independent model aligned to it). Every B
is moved by a random element of the full groups (``report.random_transform``); transformed exact
copies check the "same" verdict.

Reported: the ROC AUC of the verdict's score (the excess over the shuffled null) and the FPR / TPR
at its threshold; the same for two baselines on the same pairs, both reimplementations: the raw
weight cosine, and HuRef-style invariants (Zeng et al. 2024: ``E W_Qᵀ W_K Eᵀ``, ``E W_Vᵀ W_Oᵀ Eᵀ``,
``E W_upᵀ W_downᵀ Eᵀ``... per layer, norm gains folded, heads summed, compared by cosine),
invariant to the groups by construction and hand-coded for LLaMA, where ``compare`` reads its
groups from the graph. Then the 22 families' transformed copies (:mod:`benchmarks.provenance_families`)
and, with ``--peer-cisco``, a peer's own code on the same pairs (:mod:`benchmarks.provenance_peer`).

``python -m benchmarks.bench_provenance [--models 6] [--families all|none|NAME,...] [--peer-cisco]
[--out DIR]`` regenerates ``benchmarks/results/provenance/`` (report.md, results.json, scores.png):
about 4 minutes on one thread of a 2-core machine.
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

import symgraph
from symgraph.alignment.compare import THRESHOLD
from symgraph.testing import models

from . import provenance_peer as peer
from .families import FAMILIES
from .provenance import git_state, pyplot, save_figure, table, write_result
from .provenance_families import families_markdown, run_families

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
OUT = Path(__file__).parent / "results" / "provenance"
KINDS = ("finetune", "finetune_long", "pruned50", "int8", "merge")
NAMES = {"excess": "compare: excess over shuffled null (verdict's score)",
         "statistic": "compare: median correlation after alignment",
         "huref": "baseline (reimplementation): HuRef-style invariants, median cosine",
         "raw": "baseline: raw weight cosine, no alignment"}


def sampler(seed: int, mul: int = 3, add: int = 1, vocab: int = 64):
    """Batches (16 rows of 16 tokens) of ``x -> mul·x + add mod vocab`` with 20% noise."""
    g = torch.Generator().manual_seed(seed)

    def sample():
        seq = [torch.randint(0, vocab, (16, 1), generator=g)]
        for _ in range(15):
            nxt = (mul * seq[-1] + add) % vocab
            seq.append(torch.where(torch.rand(nxt.shape, generator=g) < 0.2,
                                   torch.randint(0, vocab, nxt.shape, generator=g), nxt))
        ids = torch.cat(seq, 1)
        return {"input_ids": ids, "labels": ids}
    return sample


def _edited(m, f):
    """A copy of ``m`` with each parameter ``p`` set to ``f(p)``."""
    m = copy.deepcopy(m)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(f(p))
    return m


def pruned(m, fraction=0.5):
    def cut(p):
        return p * (p.abs() > p.abs().flatten().kthvalue(int(fraction * p.numel())).values) if p.dim() >= 2 else p
    return _edited(m, cut)


def int8(m):
    def rounded(p):
        scale = p.abs().max().clamp_min(1e-12) / 127
        return (p / scale).round().clamp(-127, 127) * scale
    return _edited(m, rounded)


def merged(a, x):
    """The average of ``a`` and ``x`` aligned to it (parameters in the same order)."""
    xs = iter(list(symgraph.align(a, x).apply(x).parameters()))
    return _edited(a, lambda p: 0.5 * (p + next(xs)))


def huref_invariants(m) -> list:
    """HuRef-style invariant matrices of a LLaMA (by LLaMA's parameter names): each layer's
    bilinear forms sandwiched by the token embeddings E, norm gains folded, heads summed (GQA
    keys and values repeated per query head)."""
    c = m.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // heads
    sd = {k: v.detach().double() for k, v in m.state_dict().items()}
    E = sd["model.embed_tokens.weight"]

    def rep(w):
        return w.view(kv, hd, -1).repeat_interleave(heads // kv, 0).reshape(heads * hd, -1)
    out = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        g1, g2 = sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]
        q, k, v = (sd[p + f"self_attn.{n}_proj.weight"] * g1 for n in "qkv")
        o = sd[p + "self_attn.o_proj.weight"]
        up, gate = sd[p + "mlp.up_proj.weight"] * g2, sd[p + "mlp.gate_proj.weight"] * g2
        down = sd[p + "mlp.down_proj.weight"]
        out += [E @ q.T @ rep(k) @ E.T, E @ rep(v).T @ o.T @ E.T, E @ up.T @ down.T @ E.T, E @ gate.T @ down.T @ E.T]
    out.append(E @ (sd["lm_head.weight"] * sd["model.norm.weight"]).T)
    return out


def _cos(x, y) -> float:
    x, y = x.flatten(), y.flatten()
    return float(x @ y / (x.norm() * y.norm()))


def huref_score(a, b) -> float:
    return float(np.median([_cos(x, y) for x, y in zip(huref_invariants(a), huref_invariants(b))]))


def raw_score(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return float(np.median([_cos(sa[k].double(), sb[k].double()) for k in sa if sa[k].dim() >= 2]))


def compared(A, B, **kw) -> tuple[dict, object]:
    """``symgraph.compare(A, B, **kw)``'s numbers and seconds as a row, and the comparison."""
    t0 = time.perf_counter()
    res = symgraph.compare(A, B, **kw)
    return {"verdict": res.verdict, "statistic": res.statistic, "excess": res.excess, "p_value": res.p_value,
            "null_mean": res.null_mean, "max_rel_distance": res.max_rel_distance,
            "seconds": time.perf_counter() - t0}, res


def run(n_models: int, n_bases: int, steps: int, finetune_steps: int, long_steps: int, null: int,
        families=None, peer_python=None, peer_work=None) -> dict:
    """The calibration and, unless ``families`` is empty, the families' copies (None: all 22);
    with ``peer_python`` (the kit's venv's) the kit scores the same pairs, saved under ``peer_work``."""
    t_start = time.perf_counter()
    trained = []
    for s in range(n_models):
        m = models.build("llama", seed=s, **SIZES)
        models.train(m, sampler(100 + s), steps=steps, lr=3e-3)
        trained.append(m)
    t_train = time.perf_counter() - t_start
    rep = symgraph.analyze(trained[0])
    cases = [("independent", i, trained[j], 0) for i, j in itertools.combinations(range(n_models), 2)]
    for i in range(n_bases):  # (kind, A's index, B before the transform, label)
        A = trained[i]
        tuned, far = copy.deepcopy(A), copy.deepcopy(A)
        models.train(tuned, sampler(200 + i, mul=5, add=2), steps=finetune_steps, lr=1e-3)
        models.train(far, sampler(300 + i, mul=5, add=2), steps=long_steps, lr=3e-3)
        cases += [("copy", i, A, 1), ("finetune", i, tuned, 1), ("finetune_long", i, far, 1),
                  ("pruned50", i, pruned(A), 1), ("int8", i, int8(A), 1),
                  ("merge", i, merged(A, trained[(i + n_bases) % n_models]), 1)]
    rows, moved = [], []
    for n, (kind, i, B, label) in enumerate(cases):
        A, Bt = trained[i], symgraph.transform(B, rep.random_transform(seed=1000 + n))
        moved.append((i, Bt))
        row, res = compared(A, Bt, null=null, seed=n)
        rows.append({"kind": kind, "a": i, "label": label, **row, "carriers": len(res.carriers),
                     "layers": len(res.layers), "huref": huref_score(A, Bt), "raw": raw_score(A, Bt)})
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    scores = {key: peer.roc(rows, key, KINDS) for key in NAMES}
    t_cal = time.perf_counter() - t_start  # symgraph's and the baselines' time, not the peer's
    threads = torch.get_num_threads()
    peer_res = peer.run(trained, moved, rows, KINDS, peer_python, peer_work, threads) if peer_python else None
    fams = run_families(families) if families != [] else None
    neg = [r["verdict"] != "unrelated" for r in rows if r["label"] == 0]
    pos = [r for r in rows if r["label"] == 1 and r["kind"] != "copy"]
    tpr = lambda rs: float(np.mean([r["verdict"] != "unrelated" for r in rs]))  # noqa: E731
    return {"commit": git_state(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": threads,
            "sizes": SIZES, "models": n_models, "bases": n_bases, "train_steps": steps,
            "finetune_steps": finetune_steps, "long_steps": long_steps, "null_copies": null, "threshold": THRESHOLD,
            "verdict": {"fpr": float(np.mean(neg)), "false_positives": int(sum(neg)), "negatives": len(neg),
                        "tpr": tpr(pos), "tpr_by_kind": {k: tpr([r for r in pos if r["kind"] == k]) for k in KINDS},
                        "same_on_copies": all(r["verdict"] == "same" for r in rows if r["kind"] == "copy"),
                        "same_elsewhere": sum(r["verdict"] == "same" for r in rows if r["kind"] != "copy")},
            "scores": scores, "rows": rows, "families": fams, "peer_cisco": peer_res,
            "seconds": {"train": t_train, "calibration": t_cal, "total": time.perf_counter() - t_start}}


def markdown(r) -> str:
    v, s, p = r["verdict"], r["scores"], r.get("peer_cisco")
    lines = [f"# Provenance: `symgraph compare` on tiny LLaMAs (commit {r['commit']}, {r['when']})", "",
             f"{r['models']} models trained {r['train_steps']} steps from different seeds on a synthetic "
             f"language; null: their {v['negatives']} independent pairs; positives per base model "
             f"({r['bases']} bases): fine-tunes on another language ({r['finetune_steps']} steps at lr 1e-3; "
             f"finetune_long: {r['long_steps']} steps at 3e-3), 50% "
             "magnitude pruning, int8 round trip, merge with an independent model; every B moved by a "
             f"random element of the full groups. Null of the verdict: {r['null_copies']} shuffled copies "
             f"of B; threshold: excess >= {r['threshold']} and p < 1e-3.", "",
             f"**Verdict**: false-positive rate {v['fpr']:.3f} ({v['false_positives']}/{v['negatives']}), "
             f"true-positive rate {v['tpr']:.3f} "
             f"({', '.join(f'{k} {x:.2f}' for k, x in v['tpr_by_kind'].items())}); transformed exact copies "
             f"all 'same': {v['same_on_copies']}; 'same' elsewhere: {v['same_elsewhere']}. Smallest p-value "
             f"on the null pairs: {min(x['p_value'] for x in r['rows'] if x['label'] == 0):.2g} (the shuffled "
             "null is tighter than independently trained pairs: the p-value alone would not do).", ""]
    lines += table(["score", "ROC AUC", "highest null", "lowest positive (" + " / ".join(KINDS) + ")"],
                   peer.roc_rows(s, NAMES) + (peer.roc_rows(p["scores"], peer.SCORES) if p else []))
    lines += ["", f"Baselines' TPR with their threshold at the highest null score (FPR 0 on this null): "
              f"HuRef-style {s['huref']['tpr_at_fpr0']:.2f}, raw {s['raw']['tpr_at_fpr0']:.2f}.", ""]
    if p:
        lines += [*peer.summary(p), ""]
    lines += [f"Runtime: {r['seconds']['calibration']:.0f} s ({r['seconds']['train']:.0f} s training), "
              f"{r['threads']} threads{', without the peer' if p else ''}; with the families' "
              f"copies{' and the peer' if p else ''} {r['seconds']['total']:.0f} s.", ""]
    if r.get("families"):
        lines += [families_markdown(r["families"])]
    return "\n".join(lines)


def plot(r, out) -> None:
    """``scores.png``: each pair's score by kind (independent grey, derived red), per score."""
    plt = pyplot()
    panels = [("excess", "compare (excess)"), ("huref", "HuRef-style (reimpl.)"), ("raw", "raw cosine")]
    if r.get("peer_cisco"):
        panels += [("cisco", "cisco kit: pipeline"), ("cisco_identity", "cisco kit: identity"),
                   ("cisco_eas", "cisco kit: EAS alone")]
    fig, axes = plt.subplots(len(panels) // 3, 3, figsize=(11, 3.4 * (len(panels) // 3)), squeeze=False)
    kinds = ["independent", *KINDS, "copy"]
    for ax, (key, title) in zip(axes.flatten(), panels):
        for x, k in enumerate(kinds):
            ys = [row[key] for row in r["rows"] if row["kind"] == k and row.get(key) is not None]
            ax.scatter([x] * len(ys), ys, s=12, color="tab:gray" if k == "independent" else "tab:red")
        if key in ("excess", "cisco"):  # the verdict's threshold; the kit's (pipeline > 0.75)
            ax.axhline(r["threshold"] if key == "excess" else peer.THRESHOLD, ls="--", lw=0.8)
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(kinds, rotation=40, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, Path(out) / "scores.png", 120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_provenance", description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=6, help="independently trained models (null: all pairs)")
    ap.add_argument("--bases", type=int, default=3, help="models that get derived copies")
    ap.add_argument("--steps", type=int, default=200, help="training steps per model")
    ap.add_argument("--finetune-steps", type=int, default=100)
    ap.add_argument("--long-steps", type=int, default=1000, help="steps of the long fine-tune (lr 3e-3)")
    ap.add_argument("--null", type=int, default=4, help="shuffled copies per comparison (compare's default)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--families", default="all", help="families whose copies are compared: all, none or NAME,NAME")
    ap.add_argument("--peer-cisco", action="store_true", help=f"score the same pairs with {peer.NAME}")
    ap.add_argument("--peer-cisco-work", default=None, help="the peer's work directory (default "
                    "$SYMGRAPH_PEER_CISCO or /tmp/symgraph-peer-cisco)")
    ap.add_argument("--peer-cisco-venv", default=None, help="the kit's venv (default WORK/venv)")
    ap.add_argument("--peer-cisco-python", default=None, help="a Python >= 3.12 to create that venv with")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    peer_work = Path(a.peer_cisco_work) if a.peer_cisco_work else peer.default_work()
    peer_python = None
    if a.peer_cisco:
        try:
            peer_python = peer.ensure_venv(a.peer_cisco_venv or peer_work / "venv", a.peer_cisco_python)
        except peer.PeerError as e:
            ap.error(f"--peer-cisco: {e}")
    fams = None if a.families == "all" else [] if a.families == "none" else a.families.split(",")
    if fams and set(fams) - set(FAMILIES):
        ap.error(f"--families: unknown {', '.join(sorted(set(fams) - set(FAMILIES)))}; expected all, none or "
                 f"names of {', '.join(FAMILIES)}")
    res = run(a.models, a.bases, a.steps, a.finetune_steps, a.long_steps, a.null, fams, peer_python, peer_work)
    write_result(a.out, ".provenance-", res, markdown, plot)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

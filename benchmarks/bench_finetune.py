"""Benchmark: fine-tune after fusion (Imfeld et al., ICLR 2024, "Transformer fusion with optimal
transport"): a fused transformer, after a short fine-tuning, beats its converged parents?

For each pair of parents (A, B) from :func:`benchmarks.train.train_model`:

* **contestants** -- each parent as it is (``parent_a``, ``parent_b``); the fusions
  ``symgraph.merge([A, B], align="weights")`` (``fused_weights``) and ``align="activations"`` on
  :func:`benchmarks.speed.alignment_data` batches (``fused_activations``), both of A's
  architecture and width; the vanilla average ``symgraph.merge([A, B], align=None)``
  (``vanilla``), only where A and B have the same parameter shapes;
* **fine-tuning** -- every contestant trained the same ``K`` AdamW steps by
  :func:`benchmarks.train.fit` (the zoo's optimiser, warm-up cosine over the ``K`` steps), the
  zoo's batch size and the same training batches in the same order (a generator seeded with
  :data:`FINETUNE_DATA_SEED`, a seed no parent was trained with); a parent in several pairs is
  fine-tuned once;
* **curves** -- the held-out loss (:func:`benchmarks.evaluate.loss_fn_for`) at step 0 and every
  ``eval_every`` steps up to ``K``;
* **summary** -- the best parent after ``K`` steps, each fusion and the vanilla average after
  ``K`` steps, ``fusion_beats_best_parent`` with its ``margin`` (best parent's loss minus the
  best fusion's, nats: positive means fusion is better), and the first evaluated step at which a
  fusion is below the best parent at the same step, and below the best parent as trained (step
  0, the paper's "converged parents").

``python -m benchmarks.bench_finetune --out benchmarks/results/finetune [--size quick] [--K 200]``
writes ``results.json``, ``report.md`` and one ``finetune_<pair>.png`` per pair.
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

import symgraph

from . import evaluate, speed, train, zoo
from .harness import script
from .provenance import git_state, log, pyplot, save_figure, table, write_result

#: (arch A, seed A, arch B, seed B): a same-width pair and the narrow/wide pair of the suite.
DEFAULT_PAIRS = (("gpt2", 0, "gpt2", 1), ("gpt2", 0, "gpt2_wide", 1))
DEFAULT_K = {"quick": 200, "full": 500}
#: Evaluation points after step 0 by default.
DEFAULT_EVALS = 20
#: Peak fine-tuning learning rate as a fraction of the zoo's training peak rate.
FINETUNE_LR_FRACTION = 1.0 / 3.0
FINETUNE_DATA_SEED = 20_000
DEFAULT_ALIGN_BATCHES = 8
#: contestant -> (label, colour, line style).
_LOOK = {"parent_a": ("parent A", "tab:blue", "--"), "parent_b": ("parent B", "tab:cyan", "--"),
         "fused_weights": ("fused (weights)", "tab:red", "-"),
         "fused_activations": ("fused (activations)", "tab:orange", "-"),
         "vanilla": ("vanilla average", "tab:gray", ":")}


def _finetune(model, arch: str, K: int, eval_every: int, lr: float, batch_size: int, data_seed: int,
              loss_fn) -> dict:
    """Fine-tune a copy of ``model`` for ``K`` steps; the held-out loss every ``eval_every`` steps."""
    model = copy.deepcopy(model)
    sample = train.batch_sampler(zoo.get_spec(arch), batch_size, torch.Generator().manual_seed(data_seed))
    steps, losses = [0], [loss_fn(model)]

    def progress(step: int, _loss: float, _elapsed: float) -> None:
        if step % eval_every == 0:
            steps.append(step)
            losses.append(loss_fn(model))  # restores train() mode afterwards

    start = time.perf_counter()
    train_losses = train.fit(model, sample, K, lr, loss_fn=lambda m, batch: evaluate.batch_loss(m, arch, batch),
                             progress=progress)
    seconds = time.perf_counter() - start
    tail = train_losses[-max(1, K // 10):] if train_losses else [float("nan")]
    return {"arch": arch, "steps": steps, "loss": losses, "initial_loss": losses[0], "final_loss": losses[-1],
            "final_train_loss": sum(tail) / len(tail), "finetune_seconds": seconds,
            "num_parameters": sum(p.numel() for p in model.parameters())}


def _summary(contestants: dict) -> dict:
    """The summary of the module docstring; a fusion's first evaluated steps below the best parent
    at the same step and below the best parent as trained."""
    parents = [k for k in ("parent_a", "parent_b") if k in contestants]
    fused = [k for k in ("fused_weights", "fused_activations") if k in contestants]
    best_parent = min(parents, key=lambda k: contestants[k]["final_loss"])
    best_after = contestants[best_parent]["final_loss"]
    best_untuned = min(contestants[k]["initial_loss"] for k in parents)
    per_step_best = [min(contestants[k]["loss"][i] for k in parents)
                     for i in range(len(contestants[parents[0]]["loss"]))]
    per_fused = {}
    for k in fused:
        c = contestants[k]
        per_fused[k] = {"after_K": c["final_loss"], "at_step0": c["initial_loss"],
                        "beats_best_parent": c["final_loss"] < best_after, "margin": best_after - c["final_loss"],
                        "first_step_below_best_parent_same_step": next(
                            (st for st, v, ref in zip(c["steps"], c["loss"], per_step_best) if v < ref), None),
                        "first_step_below_best_parent_untuned": next(
                            (st for st, v in zip(c["steps"], c["loss"]) if v < best_untuned), None)}
    best_fused = min(fused, key=lambda k: contestants[k]["final_loss"])
    vanilla = contestants.get("vanilla")
    fused_after = contestants[best_fused]["final_loss"]
    return {"best_parent": best_parent, "best_parent_after_K": best_after,
            "best_parent_untuned": best_untuned, "fused": per_fused, "best_fused": best_fused,
            "fused_after_K": fused_after, "vanilla_after_K": vanilla["final_loss"] if vanilla else None,
            "fusion_beats_best_parent": fused_after < best_after, "margin": best_after - fused_after,
            "fusion_beats_vanilla": (fused_after < vanilla["final_loss"]) if vanilla else None}


def run(size: str = "quick", pairs=DEFAULT_PAIRS, K: int | None = None, eval_every: int | None = None,
        lr: float | None = None, steps: int | None = None, *, eval_batches: int | None = None,
        align_batches: int = DEFAULT_ALIGN_BATCHES, verbose: bool = False) -> dict:
    """The protocol (module docstring) on each of ``pairs``, ``(arch_a, seed_a, arch_b, seed_b)``
    parents of zoo ``size`` trained ``steps`` (None: the zoo's); ``K`` steps (None:
    :data:`DEFAULT_K`) evaluated every ``eval_every`` (None: ``K // 20``) on ``eval_batches``
    held-out batches (None: all); peak rate ``lr`` (None: :data:`FINETUNE_LR_FRACTION` of A's).
    ``{"protocol", "pairs"}``, a record per pair."""
    pairs = [tuple(p) for p in pairs]
    if not pairs:
        raise ValueError("pairs is empty")
    for p in pairs:
        sa, sb = zoo.get_spec(p[0]), zoo.get_spec(p[2])
        if (sa.family, sa.task, sa.dataset, sa.block_size) != (sb.family, sb.task, sb.dataset, sb.block_size):
            raise ValueError(f"pair {p!r}: the parents must share family, task, dataset and block size")
    K = DEFAULT_K[size] if K is None else int(K)
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    eval_every = max(1, K // DEFAULT_EVALS) if eval_every is None else int(eval_every)
    if eval_every < 1 or K % eval_every:
        raise ValueError(f"eval_every must be a positive divisor of K={K}, got {eval_every}")
    setting = zoo.get_setting(pairs[0][0], size)
    lr = FINETUNE_LR_FRACTION * setting.lr if lr is None else float(lr)
    say = log if verbose else (lambda msg: None)
    tune = lambda model, arch: _finetune(model, arch, K, eval_every, lr, setting.batch_size,  # noqa: E731
                                         FINETUNE_DATA_SEED, evaluate.loss_fn_for(arch, max_batches=eval_batches))
    t_start = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(train.num_threads())
    records, tuned = [], {}
    try:
        for pair in pairs:
            arch_a, seed_a, arch_b, seed_b = pair
            name = f"{arch_a} seed {seed_a} + {arch_b} seed {seed_b}"
            say(f"pair {name} ...")
            a = train.train_model(arch_a, seed_a, size, steps, verbose=verbose)
            b = train.train_model(arch_b, seed_b, size, steps, verbose=verbose)
            data = speed.alignment_data(arch_a, align_batches)
            pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
            same = set(pa) == set(pb) and all(pa[k].shape == pb[k].shape for k in pa)
            merged, merge_seconds = {}, {}
            for key, align in (("fused_weights", "weights"), ("fused_activations", "activations"), ("vanilla", None)):
                if align is not None or same:
                    t = time.perf_counter()
                    data_kw = data if align == "activations" else None
                    merged[key] = symgraph.merge([a, b], align=align, data=data_kw).model
                    merge_seconds[key] = time.perf_counter() - t
            contestants = {}
            for key, arch, seed, model in (("parent_a", arch_a, seed_a, a), ("parent_b", arch_b, seed_b, b)):
                if (arch, seed) not in tuned:
                    tuned[arch, seed] = tune(model, arch)
                contestants[key] = dict(tuned[arch, seed], seed=seed)
            contestants |= {key: tune(model, arch_a) for key, model in merged.items()}
            for key, c in contestants.items():
                say(f"  {key:<18} {c['initial_loss']:.4f} -> {c['final_loss']:.4f} ({c['finetune_seconds']:.1f}s)")
            s = _summary(contestants)
            records.append({"pair": {"name": name, "slug": f"{arch_a}-{seed_a}_{arch_b}-{seed_b}", "arch_a": arch_a,
                                     "seed_a": seed_a, "arch_b": arch_b, "seed_b": seed_b},
                            "same_width": same,
                            "vanilla_note": None if same else (
                                "vanilla average not defined: the parents have different parameter shapes "
                                "(different widths), so there is nothing to average without an alignment"),
                            "merge_seconds": merge_seconds, "contestants": contestants, "summary": s})
            say(f"  best parent {s['best_parent']} {s['best_parent_after_K']:.4f}, best fused "
                f"{s['best_fused']} {s['fused_after_K']:.4f}: beats={s['fusion_beats_best_parent']} "
                f"margin {s['margin']:+.4f}")
    finally:
        torch.set_num_threads(previous_threads)
    protocol = {"size": size, "K": K, "eval_every": eval_every, "lr": lr, "batch_size": setting.batch_size,
                "schedule": f"warmup_cosine(K, warmup {train.WARMUP_FRACTION}, min {train.MIN_LR_FRACTION})",
                "optimizer": {"name": "AdamW", "betas": list(train.ADAM_BETAS),
                              "weight_decay": train.WEIGHT_DECAY, "grad_clip": train.GRAD_CLIP},
                "data_seed": FINETUNE_DATA_SEED,
                "eval_batches": len(evaluate.eval_batches(pairs[0][0], "eval", eval_batches)),
                "align_batches": align_batches, "parent_steps": steps, "threads": train.num_threads(),
                "torch": torch.__version__, "symgraph_commit": git_state(),
                "wall_seconds": time.perf_counter() - t_start}
    return {"protocol": protocol, "pairs": records}


def plot(result: dict, out_dir) -> list[str]:
    """One PNG per pair in ``out_dir``: held-out loss vs fine-tuning step, a line per contestant;
    the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rec in result["pairs"]:
        fig, ax = pyplot().subplots(figsize=(7, 4.5))
        for name, c in rec["contestants"].items():
            label, color, style = _LOOK.get(name, (name, None, "-"))
            label += f" ({c['arch']}" + (f" seed {c['seed']})" if "seed" in c else ")")
            ax.plot(c["steps"], c["loss"], style, color=color, marker="o", ms=2.5, label=label)
        ax.axhline(rec["summary"]["best_parent_untuned"], color="k", lw=0.8, ls=(0, (1, 3)),
                   label="best parent before fine-tuning")
        ax.set_xlabel("fine-tuning step")
        ax.set_ylabel("held-out loss (nats)")
        ax.set_title(f"Fine-tune after fusion: {rec['pair']['name']}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(str(out_dir / f"finetune_{rec['pair']['slug']}.png"))
        save_figure(fig, paths[-1], bbox_inches="tight")
    return paths


def _sentence(rec: dict, K: int) -> str:
    s = rec["summary"]
    best = rec["contestants"][s["best_parent"]]
    fused = _LOOK[s["best_fused"]][0]
    parent = f"{_LOOK[s['best_parent']][0]} ({best['arch']} seed {best['seed']})"
    reach = (f"reaches {s['fused_after_K']:.4f} after {K} steps vs {s['best_parent_after_K']:.4f} for {parent} "
             f"fine-tuned the same {K} steps")
    if s["fusion_beats_best_parent"]:
        when = s["fused"][s["best_fused"]]["first_step_below_best_parent_same_step"]
        text = (f"**{rec['pair']['name']}**: yes, fusion + fine-tune beats the best parent: {fused} {reach} (margin "
                f"{s['margin']:.4f} nats); it is first below the best parent at equal steps at step {when}.")
    else:
        text = (f"**{rec['pair']['name']}**: no, fusion + fine-tune does not beat the best parent: the best fusion, "
                f"{fused}, {reach} ({-s['margin']:.4f} nats behind).")
    below = [f"{_LOOK[k][0]} at step {f['first_step_below_best_parent_untuned']}" for k, f in s["fused"].items()
             if f["first_step_below_best_parent_untuned"] is not None]
    text += (f" Below the best parent as trained (step 0, {s['best_parent_untuned']:.4f}): "
             + (", ".join(below) if below else "never within the budget") + ".")
    if s["vanilla_after_K"] is None:
        return text + f" No vanilla contestant: {rec['vanilla_note']}."
    gap = abs(s["vanilla_after_K"] - s["fused_after_K"])
    return text + (f" The vanilla average + fine-tune reaches {s['vanilla_after_K']:.4f}, {gap:.4f} nats "
                   f"{'behind' if s['fusion_beats_vanilla'] else 'ahead of'} the best fusion.")


def markdown(result: dict) -> str:
    """``report.md``: the protocol, one table and one sentence per pair."""
    p = result["protocol"]
    K = p["K"]
    lines = [
        "# Fine-tune after fusion", "",
        "Protocol of Imfeld et al. (ICLR 2024, \"Transformer fusion with optimal transport\"): fuse two "
        f"parents, fine-tune the fused model for K = {K} steps, and compare with each parent fine-tuned "
        "for the same K steps and with the vanilla average (no alignment) + K steps.", "",
        f"Size **{p['size']}**; every contestant: AdamW (betas {tuple(p['optimizer']['betas'])}, weight decay "
        f"{p['optimizer']['weight_decay']} on matrices, gradient clip {p['optimizer']['grad_clip']}), peak lr "
        f"{p['lr']:.3g}, {p['schedule']}, batch {p['batch_size']}, the same training batches in the same "
        f"order (data seed {p['data_seed']}). Held-out loss (nats) on {p['eval_batches']} held-out batches "
        f"at step 0 and every {p['eval_every']} steps. Activation alignment on {p['align_batches']} "
        f"training batches. {p['threads']} torch thread(s), torch {p['torch']}, symgraph at "
        f"`{p['symgraph_commit']}`; wall time {p['wall_seconds']:.0f} s.", "",
        "Regenerate: `python -m benchmarks.bench_finetune --out benchmarks/results/finetune "
        f"--size {p['size']} --K {K} --eval-every {p['eval_every']} --lr {p['lr']:.6g}"
        + (f" --steps {p['parent_steps']}" if p["parent_steps"] is not None else "") + "`.", ""]
    for rec in result["pairs"]:
        s = rec["summary"]
        rows = []
        for name, c in rec["contestants"].items():
            final = f"{c['final_loss']:.4f}"
            if name == s["best_parent"] or (name == s["best_fused"] and s["fusion_beats_best_parent"]):
                final = f"**{final}**"
            model = c["arch"] + (f" seed {c['seed']}" if "seed" in c else " (A's shape)")
            rows.append([_LOOK.get(name, (name,))[0], model, f"{c['initial_loss']:.4f}", final,
                         f"{s['best_parent_after_K'] - c['final_loss']:+.4f}"])
        if rec["vanilla_note"]:
            rows.append(["vanilla average", "—", "—", "—", "—"])
        header = ["contestant", "model", "loss at step 0", f"loss after {K} steps", "best parent − this"]
        lines += [f"## {rec['pair']['name']}", "", *table(header, rows), "", _sentence(rec, K), "",
                  f"![{rec['pair']['name']}](finetune_{rec['pair']['slug']}.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """``python -m benchmarks.bench_finetune --out DIR``: run, then write ``results.json``,
    ``report.md`` and the PNGs into DIR."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_finetune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--size", choices=zoo.SIZES, default="quick")
    ap.add_argument("--K", type=int, default=None, help="fine-tuning steps (default: 200 quick, 500 full)")
    ap.add_argument("--eval-every", type=int, default=None, help="evaluation interval (default K // 20)")
    ap.add_argument("--lr", type=float, default=None, help="peak fine-tuning lr (default 1/3 of the zoo's)")
    ap.add_argument("--steps", type=int, default=None, help="override the parents' training steps (tests)")
    ap.add_argument("--eval-batches", type=int, default=None, help="held-out batches (default all)")
    ap.add_argument("--align-batches", type=int, default=DEFAULT_ALIGN_BATCHES)
    a = ap.parse_args(argv)
    result = run(a.size, K=a.K, eval_every=a.eval_every, lr=a.lr, steps=a.steps,
                 eval_batches=a.eval_batches, align_batches=a.align_batches, verbose=True)

    def figures(res, tmp):  # the record names its figures
        res["protocol"]["figures"] = [Path(f).name for f in plot(res, tmp)]
    write_result(a.out, ".finetune-", result, markdown, figures)
    n = len(result["protocol"]["figures"])
    print(f"wrote {Path(a.out).resolve()}/results.json, report.md and {n} figure(s)")
    return result


if __name__ == "__main__":
    script(main)

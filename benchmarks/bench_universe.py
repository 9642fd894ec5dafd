"""Benchmark: N models merged in one universe vs to an anchor.

For each architecture, ``max(n_models)`` models are trained from seeds 0, 1, ...
(:func:`benchmarks.train.train_model`), and for each N the first N are averaged three ways:
``vanilla`` (no alignment), ``anchor`` (every model aligned to model 0, ``symgraph.merge``'s
default) and ``universe`` (every model aligned to the mean of the others until no element
changes: ``anchor="universe"``, MergeMany).

Barrier of the N-model average: ``L(merged) − mean_i L(θ_i)`` on the held-out batches
(:func:`benchmarks.evaluate.loss_fn_for`). A universe record also carries its rounds, the
changed elements per round, whether it converged, and the spread ``Σ w_i‖θ_i − θ̄‖² / Σ
w_i‖θ_i‖²`` after the anchor round and at the end.

``python -m benchmarks.bench_universe [--size quick] [--archs gpt2 llama] [--n 3 4 5]
[--out DIR]`` prints the table and writes ``universe.json``, ``universe.md`` and plots.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import symgraph

from . import evaluate, speed, train, zoo
from .provenance import log, pyplot, save_figure, table, write_result

MODES = ("vanilla", "anchor", "universe")
ARCHS = ("gpt2", "llama", "bert", "vit")


def run(size: str = "quick", archs=ARCHS, n_models=(3, 4, 5), steps: int | None = None, *,
        eval_batches: int | None = 4, align_batches: int = 4, align: str = "weights",
        universe_options: dict | None = None, verbose: bool = True) -> list[dict]:
    """One record per (arch, N, mode); ``steps`` overrides the training steps (tests),
    ``eval_batches`` the held-out batches of every loss (None: all), ``align`` is "weights" or
    "activations" (on ``align_batches`` training batches)."""
    n_models = sorted({int(n) for n in n_models})
    if not n_models or n_models[0] < 2:
        raise ValueError(f"n_models must be numbers of models >= 2, got {n_models}")
    seeds = tuple(range(n_models[-1]))
    records = []
    for arch in archs:
        t = time.perf_counter()
        models = [train.train_model(arch, s, size, steps) for s in seeds]
        if verbose:
            log(f"{arch}: {len(models)} models ready in {time.perf_counter() - t:.1f}s")
        data = speed.alignment_data(arch, align_batches)
        loss_fn = evaluate.loss_fn_for(arch, max_batches=eval_batches)
        losses = [loss_fn(m) for m in models]
        for n in n_models:
            mean_parent = sum(losses[:n]) / n
            for mode in MODES:
                kw = {"align": None if mode == "vanilla" else align}
                if align == "activations" and mode != "vanilla":
                    kw["data"] = data
                if mode == "universe":
                    kw |= {"anchor": "universe", "universe_options": universe_options}
                t = time.perf_counter()
                res = symgraph.merge(models[:n], data[0], **kw)
                seconds = time.perf_counter() - t
                loss = loss_fn(res.model)
                rec = {"arch": arch, "size": size, "n_models": n, "seeds": list(seeds[:n]), "mode": mode,
                       "align": kw["align"], "steps": steps, "parent_losses": losses[:n],
                       "mean_parent_loss": mean_parent, "loss_merged": loss, "barrier": loss - mean_parent,
                       "seconds": seconds, "align_seconds": res.timings.get("align", 0.0),
                       "rounds": None, "converged": None, "stopped": None, "changed": None,
                       "spread_anchor": None, "spread": None}
                u = res.universe
                if u is not None:
                    rec |= {k: u[k] for k in ("rounds", "converged", "stopped", "changed", "drifted", "max_change",
                                              "round_seconds")}
                    rec |= {"spread_anchor": u["distance"][0], "spread": u["distance"][-1]}
                records.append(rec)
                if verbose:
                    extra = "" if u is None else f"  rounds {rec['rounds']} ({rec['stopped']}) changed {rec['changed']}"
                    log(f"  {arch} N={n} {mode:<8} L {loss:.4f} (parents {mean_parent:.4f}) "
                        f"barrier {rec['barrier']:+.4f}  {seconds:6.1f}s{extra}")
    return records


def _table(records):
    """``{(arch, n): {mode: record}}`` in the order the records came."""
    rows = {}
    for r in records:
        rows.setdefault((r["arch"], r["n_models"]), {})[r["mode"]] = r
    return rows


def markdown(records) -> str:
    """Per architecture and N the barrier of each mode, the universe's gain over the anchor, its
    rounds and spreads."""
    both = [by for by in _table(records).values() if "universe" in by and "anchor" in by]
    wins = sum(by["universe"]["barrier"] < by["anchor"]["barrier"] for by in both)
    lines = ["# N models: anchor vs universe", "",
             "Barrier of the N-model average, `L(merged) − mean parent loss` (lower is better): "
             "`vanilla` averages without alignment, `anchor` aligns every model to model 0, "
             "`universe` aligns every model to the mean of the others until no element changes "
             "(`symgraph.merge(..., anchor=\"universe\")`, MergeMany). Weight matching; "
             f"the universe has the lower barrier in {wins} of {len(both)} rows.", "",
             "![barrier](universe_barrier.png) ![rounds](universe_rounds.png)", ""]
    fmt = lambda x: "—" if x is None else f"{x:+.4f}"  # noqa: E731
    rows = []
    for (arch, n), by in _table(records).items():
        b = {m: (by[m]["barrier"] if m in by else None) for m in MODES}
        u, a = by.get("universe"), by.get("anchor")
        rows.append([arch, n, f"{next(iter(by.values()))['mean_parent_loss']:.4f}", fmt(b["vanilla"]),
                     fmt(b["anchor"]), fmt(b["universe"]), fmt(b["universe"] - b["anchor"]) if u and a else "—",
                     f"{u['rounds']}" if u else "—",
                     ("yes" if u["converged"] else f"no ({u['stopped']})") if u else "—",
                     f"{u['spread_anchor']:.4f} → {u['spread']:.4f}" if u else "—",
                     f"{a['align_seconds']:.1f} / {u['align_seconds']:.1f}" if u and a else "—"])
    lines += table(["arch", "N", "mean parent loss", "vanilla", "anchor", "universe", "universe − anchor",
                    "rounds", "converged", "spread anchor → universe", "align s (anchor / universe)"], rows)
    return "\n".join(lines) + "\n"


def plot(records, out_dir) -> list[str]:
    """``universe_barrier.png`` (barrier against N, a panel per architecture, a line per mode)
    and ``universe_rounds.png`` (changed elements per universe round); the file names written."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    archs = list(dict.fromkeys(r["arch"] for r in records))
    if not archs:
        return []
    fig, axes = plt.subplots(1, len(archs), figsize=(4 * len(archs), 3.4), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        for mode, style in zip(MODES, ("o--", "s-", "^-")):
            rs = sorted((r for r in records if r["arch"] == arch and r["mode"] == mode), key=lambda r: r["n_models"])
            if rs:
                ax.plot([r["n_models"] for r in rs], [r["barrier"] for r in rs], style, label=mode)
        ax.set_title(arch)
        ax.set_xlabel("models merged (N)")
        ax.axhline(0, color="grey", lw=0.5)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel("L(average) − mean parent loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    written = [save_figure(fig, out / "universe_barrier.png", bbox_inches="tight")]
    uni = [r for r in records if r["mode"] == "universe" and r["changed"]]
    if uni:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for r in uni:
            ax.plot(range(1, len(r["changed"]) + 1), r["changed"], "o-", label=f"{r['arch']} N={r['n_models']}")
        ax.set_xlabel("universe round")
        ax.set_ylabel("elements changed")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(save_figure(fig, out / "universe_rounds.png", bbox_inches="tight"))
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_universe", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="quick", choices=zoo.SIZES)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS))
    ap.add_argument("--n", nargs="+", type=int, default=[3, 4, 5], help="numbers of models merged")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the zoo's)")
    ap.add_argument("--eval-batches", type=int, default=4, help="held-out batches per loss (0: all)")
    ap.add_argument("--align", default="weights", choices=("weights", "activations"))
    ap.add_argument("--max-rounds", type=int, default=None)
    ap.add_argument("--out", default=None, help="directory for universe.json / .md / plots")
    args = ap.parse_args(argv)
    opts = None if args.max_rounds is None else {"max_rounds": args.max_rounds}
    records = run(args.size, args.archs, args.n, args.steps, eval_batches=args.eval_batches or None,
                  align=args.align, universe_options=opts)
    print(markdown(records))
    if args.out:
        write_result(args.out, ".universe-", records, markdown, plot, "universe.json", "universe.md")


if __name__ == "__main__":
    main()

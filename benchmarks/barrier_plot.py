"""The suite's barrier figure (``barrier_ARCH.png``; the LLaMA one is the README's): the held-out
loss along the line from B (λ=0) to A (λ=1) for a few methods, named as the docs name them.

A curve is drawn only where it runs from B's loss to A's (:func:`ends_at_the_parents`): a method
whose B′ is not B moved by a symmetry (a soft transport map between widths) starts elsewhere and is
left to the report's tables, as are the merged models that are no interpolation (Fisher,
RegMean, REPAIR). The legend sits beside the axes, never over the curves.

``python -m benchmarks.barrier_plot DIR`` redraws ``DIR/barrier_*.png`` from the suite's committed
``DIR/results.json`` (the suite itself takes hours) and adds their entry to ``DIR/record.json``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .provenance import pyplot, register, save_figure
from .records import renamed

#: The methods drawn, in order, in the docs' names (docs/benchmarks.md, docs/align.md).
LABELS = {"vanilla": "vanilla (no alignment)", "verma2024": "Verma & Elbayad 2024 (permutations)",
          "symgraph_weights": "symgraph: weight matching", "symgraph_activations": "symgraph: activation matching",
          "symgraph_refine": "symgraph: learned matching"}
HERO = tuple(LABELS)
#: The most a curve's ends may differ from the parents' losses (nats): B′ is B moved by a symmetry.
ENDS_TOL = 1e-3
_STYLE = {"vanilla": ("k", ":"), "verma2024": ("tab:orange", "--"), "symgraph_weights": ("tab:blue", "-"),
          "symgraph_activations": ("tab:purple", "-"), "symgraph_refine": ("tab:green", "-")}


def ends_at_the_parents(record) -> bool:
    """Whether ``record``'s curve starts at B's loss (λ=0) and ends at A's (λ=1)."""
    (l0, y0), (l1, y1) = record["curve"][0], record["curve"][-1]
    return (l0, l1) == (0.0, 1.0) and abs(y0 - record["loss_b"]) <= ENDS_TOL and abs(y1 - record["loss_a"]) <= ENDS_TOL


def curves(records, arch, methods=HERO) -> dict:
    """``{method: (λs, mean loss over pairs)}`` of ``methods`` for ``arch`` whose every pair's curve
    runs from B's loss to A's (records under the current names: :func:`~benchmarks.records.renamed`)."""
    out = {}
    for name in methods:
        rs = [r for r in renamed(records) if r.get("arch") == arch and r.get("method") == name
              and r.get("kind") == "interpolation" and r.get("curve")]
        if rs and all(ends_at_the_parents(r) for r in rs):
            out[name] = ([x for x, _ in rs[0]["curve"]], np.mean([[y for _, y in r["curve"]] for r in rs], axis=0))
    return out


def figure(records, arch, methods=HERO):
    """The figure of ``arch``: the loss along λ of :func:`curves`, and the parents' mean loss."""
    fig, ax = pyplot().subplots(figsize=(8.6, 4.2))
    drawn = curves(records, arch, methods)
    for name, (lam, loss) in drawn.items():
        colour, style = _STYLE.get(name, (None, "-"))
        ax.plot(lam, loss, style, color=colour, marker="o", ms=2.5, lw=1.4, label=LABELS.get(name, name))
    recs = [r for r in renamed(records) if r.get("arch") == arch and r.get("method") in drawn]
    pairs = {tuple(r["pair"]) for r in recs}
    if recs:
        first = [r for r in recs if r["method"] == recs[0]["method"]]
        ax.axhline(float(np.mean([0.5 * (r["loss_a"] + r["loss_b"]) for r in first])), color="grey", lw=0.8,
                   ls="-.", label="mean of the parents' losses")
    ax.set_xlabel("λ   (λ·θ_A + (1−λ)·θ_B′;  λ=0 is B, λ=1 is A)")
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title(f"{arch}: loss between two models trained from different seeds "
                 f"(mean over {len(pairs)} pair{'s' * (len(pairs) != 1)})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return fig


def barrier_plot(path: Path, records, arch, methods=HERO) -> str:
    """:func:`figure` of ``arch`` written to ``path``; its name."""
    return save_figure(figure(records, arch, methods), path, bbox_inches="tight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.barrier_plot", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a suite results directory (its results.json)")
    a = ap.parse_args(argv)
    d = Path(a.dir)
    if not (d / "results.json").is_file():
        print(f"python -m benchmarks.barrier_plot: no results.json in {d}", file=sys.stderr)
        return 2
    records = json.loads((d / "results.json").read_text())
    archs = sorted({r["arch"] for r in records if r.get("kind") == "interpolation"})
    names = [barrier_plot(d / f"barrier_{arch}.png", records, arch) for arch in archs]
    register(d, names)
    print("wrote " + ", ".join(str(d / n) for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

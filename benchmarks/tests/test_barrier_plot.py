"""The suite's barrier figure, the README's hero plot (issue 62): methods named as the docs name
them (no ``seed002``), at most six entries, every curve from B's loss (λ=0) to A's (λ=1), and the
legend beside the axes, not over the curves — checked on the committed suite results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.barrier_plot import HERO, LABELS, curves, ends_at_the_parents, figure
from benchmarks.records import FORMER_NAMES, renamed

SUITE = Path(__file__).resolve().parent.parent / "results" / "suite"


@pytest.fixture(scope="module")
def records():
    return json.loads((SUITE / "results.json").read_text())


def test_the_hero_plot_is_readable(records):
    import matplotlib.pyplot as plt
    fig = figure(records, "llama")
    try:
        ax = fig.axes[0]
        names = [t.get_text() for t in ax.get_legend().get_texts()]
        assert 4 <= len(names) <= 6, names
        assert not any(old in n for n in names for old in FORMER_NAMES), names
        assert names[:-1] == [LABELS[m] for m in HERO]  # each drawn, in the docs' names
        fig.canvas.draw()
        legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= axes.x1  # beside the axes, over no curve
        for line in ax.get_lines()[:-1]:  # the curves (the last line: the parents' mean loss)
            xs = list(line.get_xdata())
            assert xs[0] == 0.0 and xs[-1] == 1.0
    finally:
        plt.close(fig)


def test_every_curve_runs_from_b_to_a(records):
    recs = renamed(records)
    drawn = curves(records, "llama")
    assert list(drawn) == list(HERO)
    for name, (lam, loss) in drawn.items():
        rs = [r for r in recs if r["arch"] == "llama" and r["method"] == name and r["kind"] == "interpolation"]
        mean_b = sum(r["loss_b"] for r in rs) / len(rs)
        mean_a = sum(r["loss_a"] for r in rs) / len(rs)
        assert loss[0] == pytest.approx(mean_b, abs=1e-3) and loss[-1] == pytest.approx(mean_a, abs=1e-3), name


def test_a_curve_that_does_not_start_at_b_is_not_drawn(records):
    """Imfeld et al.'s soft maps give a B′ that is not B moved by a symmetry: its curve starts
    above B's loss, and a method asked for with such a curve is left out."""
    imfeld = [r for r in renamed(records) if r.get("method") == "imfeld2024" and r.get("arch") == "llama"]
    assert imfeld and not all(ends_at_the_parents(r) for r in imfeld)
    assert "imfeld2024" not in curves(records, "llama", HERO + ("imfeld2024",))

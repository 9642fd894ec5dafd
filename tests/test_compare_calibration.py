"""The provenance verdict (issue 62): compare.png paints a layer as carrying a match only when the
verdict says B comes from A (an "unrelated" or "undetermined" verdict paints none, however high a
layer's correlation), and the library's threshold is the one the calibration on trained
independent pairs chose (``benchmarks/results/provenance_calibration/``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from symgraph.alignment.compare import THRESHOLD, judge
from symgraph.cli.compare import CARRIES, NOT_CARRYING, layer_bars, plot_layers

def rows(correlations: dict) -> list:
    """Rows of ``measure`` with the given correlation per tensor name (``layer.k.w``)."""
    return [{"name": n, "layer": n.rsplit(".", 1)[0], "shape": [4, 4], "rel_distance": 1.0 - c, "cosine": c,
             "correlation": c, "gauge": False} for n, c in correlations.items()]


def verdict(b_rows: dict, null_level: float, null: int = 4):
    """:func:`judge` of B with ``b_rows``' correlations against a null whose every tensor
    correlates ``null_level`` (± a little per draw)."""
    def solve(draw):
        if draw is None:
            return None, rows(b_rows)
        return None, rows({n: null_level + 0.01 * (draw - 1.5) for n in b_rows})
    return judge(solve, 1e-5, null=null)


# one layer far above the level a layer needs, the rest at the null's: the median is the null's
HIGH_LAYER = {"m.layers.0.q": 0.95, "m.layers.0.k": 0.95, "m.layers.1.q": 0.2, "m.layers.1.k": 0.2,
              "m.layers.2.q": 0.2, "m.layers.2.k": 0.2, "lm_head.w": 0.2}


def test_an_unrelated_verdict_paints_no_layer_as_a_match(tmp_path):
    res = verdict(HIGH_LAYER, 0.2)
    assert res.verdict == "unrelated"
    assert max(r["excess"] for r in res.layers) > res.threshold  # a layer clears the threshold ...
    assert res.carriers == [] and not any(r["carries"] for r in res.layers)  # ... yet carries nothing
    bars = layer_bars(res)
    assert [name for name, _, _ in bars] == ["m.layers.0", "m.layers.1", "m.layers.2", "lm_head"]
    assert bars[0][1] == pytest.approx((0.95 - 0.2) / (1 - 0.2))  # its excess over its own null level
    assert {colour for _, _, colour in bars} == {NOT_CARRYING}
    plot_layers(res, str(tmp_path / "compare.png"), "unrelated")
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_a_derived_verdict_paints_the_layers_above_the_level():
    derived = dict(HIGH_LAYER, **{"m.layers.1.q": 0.9, "m.layers.1.k": 0.9, "lm_head.w": 0.9})
    res = verdict(derived, 0.2)
    assert res.verdict == "derived" and res.excess >= THRESHOLD
    colours = {name: colour for name, _, colour in layer_bars(res)}
    assert colours == {"m.layers.0": CARRIES, "m.layers.1": CARRIES, "m.layers.2": NOT_CARRYING,
                       "lm_head": CARRIES}
    assert res.carriers == ["m.layers.0", "m.layers.1", "lm_head"]


def test_no_null_paints_nothing():
    res = verdict(HIGH_LAYER, 0.2, null=0)
    assert res.verdict == "undetermined"
    assert {colour for _, _, colour in layer_bars(res)} == {NOT_CARRYING}


def test_the_excess_reads_each_matrix_against_its_own_null_and_leaves_vectors_out():
    """A matrix's excess is measured from its own null level (a large matrix aligned by continuous
    groups correlates with noise; a vector hardly); vectors (biases, shifts: alike from the same
    data) are evidence only where a layer has no matrix."""
    b = {"m.layers.0.w": 0.6, "m.layers.1.w": 0.3, "m.layers.1.b": 0.99, "m.norm.b": 0.9}
    levels = {"m.layers.0.w": 0.4, "m.layers.1.w": 0.0, "m.layers.1.b": 0.0, "m.norm.b": 0.5}
    shapes = {"m.layers.0.w": [8, 8], "m.layers.1.w": [8, 8], "m.layers.1.b": [8], "m.norm.b": [8]}

    def with_shapes(corr):
        return [r | {"shape": shapes[r["name"]]} for r in rows(corr)]

    def solve(draw):
        if draw is None:
            return None, with_shapes(b)
        return None, with_shapes({n: v + 0.01 * (draw - 1.5) for n, v in levels.items()})
    res = judge(solve, 1e-5, null=4)
    ex = {r["name"]: r["excess"] for r in res.tensors}
    assert ex["m.layers.0.w"] == pytest.approx((0.6 - 0.4) / 0.6) and ex["m.layers.1.w"] == pytest.approx(0.3)
    assert res.excess == pytest.approx(0.5 * ((0.6 - 0.4) / 0.6 + 0.3))  # the median of the two matrices
    assert res.statistic == pytest.approx(0.45)  # the median correlation of the matrices, the vectors left out
    layers = {r["layer"]: r for r in res.layers}
    assert layers["m.layers.1"]["tensors"] == 1 and layers["m.layers.1"]["excess"] == pytest.approx(0.3)
    assert layers["m.norm"]["tensors"] == 1 and layers["m.norm"]["excess"] == pytest.approx(0.8)  # no matrix there


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "provenance_calibration"


def test_the_library_threshold_is_the_calibrated_one():
    """The default is the threshold the calibration chose by its stated rule (the midpoint of the
    highest independent and the lowest derived excess), and at it no independent pair of the
    calibration is called derived while every derived copy is (or "same")."""
    r = json.loads((RESULTS / "results.json").read_text())
    assert THRESHOLD == pytest.approx(r["chosen_threshold"])
    assert len(r["families"]) >= 3 and r["seeds"] >= 4
    at = r["at_chosen"]
    assert at["negatives"] == len(r["families"]) * r["seeds"] * (r["seeds"] - 1) // 2  # every independent pair
    assert at["false_positives"] == 0 and at["tpr"] == 1.0, at
    null = [x["excess"] for x in r["rows"] if x["kind"] == "independent"]
    derived = [x["excess"] for x in r["rows"] if x["kind"] not in ("independent", "permuted")]
    assert max(null) < THRESHOLD <= min(derived)
    assert THRESHOLD == pytest.approx(round(0.5 * (max(null) + min(derived)), 2))

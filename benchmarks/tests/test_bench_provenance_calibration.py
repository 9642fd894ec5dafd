"""The provenance calibration (issue 62): its threshold rule, the rates at a threshold recomputed
from each pair's excess and p-value as ``judge`` decides, and a tiny run end to end."""
from __future__ import annotations

import pytest

from benchmarks import bench_provenance_calibration as cal


def row(kind, excess, p=1e-9, verdict=None):
    return {"family": "llama", "kind": kind, "excess": excess, "p_value": p,
            "verdict": verdict or ("derived" if excess >= 0.3 and p < 1e-3 else "unrelated")}


def test_the_threshold_is_the_midpoint_between_the_null_and_the_derived():
    assert cal.choose_threshold([0.1, 0.23, 0.15], [0.35, 0.9]) == (
        0.29, "midpoint of the highest independent and the lowest derived excess")
    t, rule = cal.choose_threshold([0.1, 0.4], [0.35, 0.9])  # overlap: no false positive on this null
    assert t == 0.41 and "overlap" in rule


def test_rates_follow_the_verdicts_rule_at_any_threshold():
    rows = [row("independent", 0.2), row("independent", 0.31, p=0.01), row("independent", 0.1),
            row("finetune", 0.35), row("finetune_long", 0.28), row("permuted", 1.0, p=None, verdict="same")]
    at = cal.rates(rows, 0.3)
    assert (at["false_positives"], at["negatives"]) == (0, 3)  # 0.31 has p 0.01: not derived
    assert (at["true_positives"], at["positives"]) == (2, 3)
    assert at["tpr_by_kind"] == {"finetune": 1.0, "finetune_long": 0.0, "permuted": 1.0}
    low = cal.rates(rows, 0.15)
    assert low["false_positives"] == 1 and low["fpr"] == pytest.approx(1 / 3) and low["tpr"] == 1.0


@pytest.mark.slow
def test_a_tiny_run_end_to_end(tmp_path):
    r = cal.run(["llama"], seeds=2, bases=1, steps=4)
    kinds = [x["kind"] for x in r["rows"]]
    assert kinds == ["independent", "continued", "finetune", "finetune_long", "permuted"]
    assert r["rows"][-1]["verdict"] == "same" and r["rows"][1]["verdict"] == "derived"
    assert r["at_library"]["negatives"] == 1 and r["at_library"]["positives"] == 4
    assert r["chosen_threshold"] is not None and 0 < r["chosen_threshold"] < 1
    md = cal.markdown(r)
    assert "Chosen threshold" in md and "| llama | 1 |" in md
    cal.plot(r, tmp_path)
    assert (tmp_path / "excess.png").stat().st_size > 1000

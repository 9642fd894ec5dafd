"""A coverage row the benchmarks' tests assert: run, traced, certified and complete."""
from __future__ import annotations

from benchmarks import coverage as cov


def row_sound_and_complete(model_type, class_name, task):
    """The coverage row of ``model_type``'s ``class_name`` on ``task``, asserted to run without
    error, trace, certify (≤ 1e-6, sound) and be complete (no structure missing)."""
    r = cov.run_family(model_type, class_name, task)
    assert r["error"] is None, r["error"]
    assert r["traced"] and r["stage"] == "done"
    assert r["certificate"] <= 1e-6 and r["sound"]
    assert r["complete"] and r["structure"]["missing"] == []
    return r

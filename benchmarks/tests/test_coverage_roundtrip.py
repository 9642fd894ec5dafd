"""The round trip of ``benchmarks/coverage/roundtrip.py``: a tiny family's checkpoint merged with
its moved copy through the command line's path is the checkpoint; each kind of row gets its
verdict; the table has a line per row."""
from __future__ import annotations

import pytest

from benchmarks.coverage import roundtrip as rt

pytestmark = pytest.mark.slow


def test_gpt2_merged_with_its_moved_copy_is_gpt2():
    row = rt.run_row("gpt2", "GPT2LMHeadModel", "causal_lm")
    assert row["failure"] is None and row["stage"] == "done" and row["verdict"] == "ok"
    assert row["dtype"] == "float64" and row["merged_dtype"] == "float64"
    assert row["groups"] >= 5 and row["moved_weights"] > 0.1   # the copy really moved
    assert row["moved_error"] < 1e-10 and row["moved_saved_error"] < 1e-10
    assert row["error"] < 1e-10 and row["error_as_run"] < 1e-10


@pytest.mark.parametrize("fields, want", [
    (dict(tol=1e-6, moved_error=1e-12, moved_saved_error=1e-12, error=1e-12), "ok"),
    (dict(tol=1e-6, moved_error=1e-12, moved_saved_error=1e-12, error=3e-3), "merge differs"),
    (dict(tol=1e-6, moved_error=0.0, moved_saved_error=0.0, error=0.0, unread="x is never read"), "nothing to align"),
    (dict(tol=1e-6, moved_error=0.0, moved_saved_error=0.0, error=0.2, unread="x is never read"), "merge differs"),
    (dict(tol=1e-6, moved_error=1e-12, moved_saved_error=0.4, error=None,
          failure={"stage": "merge", "transformers_fails": False}), "analysis bug"),
    (dict(tol=1e-6, moved_error=float("nan"), error=None), "analysis bug"),
    (dict(tol=1e-4, moved_error=5e-5, moved_saved_error=5e-5, error=5e-5), "ok"),
    (dict(failure={"stage": "reload", "transformers_fails": True}), "transformers fails"),
    (dict(failure={"stage": "merge", "transformers_fails": False}), "ours fails"),
    (dict(failure={"stage": "timeout", "transformers_fails": False}), "timeout")])
def test_verdicts(fields, want):
    assert rt.verdict(fields) == want


def test_table_has_a_line_per_row():
    rows = [{"model_type": m, "class": "C", "task": "causal_lm", "verdict": v, "error": e, "failure": f}
            for m, v, e, f in (("a", "ok", 1e-15, None),
                               ("b", "ours fails", None, {"stage": "merge", "type": "InputError", "message": "no"}))]
    header = {"command": "python -m benchmarks.coverage.roundtrip", "git": {"commit": "abc"}, "jobs": 1,
              "machine": {"transformers": "5", "torch": "2", "cores": 2}, "timeout_s": 300, "mem_gb": 6,
              "wall_seconds": 3, "only": ["a", "b"], "tasks": ["causal_lm"]}
    md = rt.markdown({"header": header, "rows": rows})
    assert "| 1 | 0 | 0 | 0 | 1 | 0 | 0 |" in md
    assert "| a | C | causal_lm | ok |" in md and "merge: InputError: no" in md

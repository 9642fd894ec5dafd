"""benchmarks.bench_coverage_diffusers on one model (the DiT): its row's numbers, the markdown
table, and the record naming the command."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_coverage_diffusers as bench

pytest.importorskip("diffusers")


def test_dit_row_table_and_record(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.provenance.matmul_rates", lambda n=2048: {})  # no timing run
    assert bench.main(["--models", "dit", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "coverage.json").read_text())
    (row,) = res["rows"]
    assert row["model"] == "dit" and row["class"] == "DiTTransformer2DModel" and row["error"] is None
    assert row["traced"] and row["sound"] and row["complete"] and row["missing"] == []
    assert row["certificate"] < 1e-9 and row["recovery_error"] < 1e-6 < 0.1 < row["moved"]
    # its position table is not saved (loading computes it again), so the stream it is added to
    # stays as it is: the stream's tensors fixed, not missing
    assert row["frozen_ops"] == [] and "pos_embed.proj.weight" in row["fixed_params"]
    assert "proj_out_2.bias" in row["fixed_params"] and row["moved_buffers"] == []
    assert "non-persistent" in row["fixed_buffers"]["pos_embed.pos_embed"]
    md = (tmp_path / "coverage.md").read_text()
    assert "| dit | DiTTransformer2DModel |" in md and "python -m benchmarks coverage_diffusers --models dit" in md
    record = json.loads((tmp_path / "record.json").read_text())
    assert "coverage_diffusers --models dit" in json.dumps(record)


def test_a_failing_model_is_a_row_not_a_crash(monkeypatch):
    def broken(d, g):
        raise RuntimeError("no such config")
    monkeypatch.setitem(__import__("symgraph.testing.diffusion", fromlist=["BUILDERS"]).BUILDERS, "dit", broken)
    row = bench.row("dit")
    assert row["traced"] is False and row["error"] == {"stage": "build", "type": "RuntimeError",
                                                       "message": "no such config"}

"""benchmarks.bench_universe on a toy setting: ViT (no tokenizer to train), 3 seeds trained for a
few steps into a temporary cache, N = 2 and 3."""
from __future__ import annotations

import math

import pytest

from benchmarks import bench_universe, train

pytestmark = pytest.mark.slow  # trains 3 ViTs and runs universe alignment in its fixture (setup minutes)

STEPS = 10


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SYMGRAPH_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("SYMGRAPH_NUM_THREADS", "1")  # training threads: one core is what a test gets
    try:
        recs = bench_universe.run("quick", archs=("vit",), n_models=(2, 3), steps=STEPS,
                                  eval_batches=2, align_batches=2, verbose=False,
                                  universe_options={"max_rounds": 3})
        assert all(train.is_cached("vit", s, "quick", STEPS) for s in (0, 1, 2))
    finally:
        mp.undo()
    return recs


def test_records(records):
    assert [(r["n_models"], r["mode"]) for r in records] == [
        (n, m) for n in (2, 3) for m in ("vanilla", "anchor", "universe")]
    for r in records:
        assert r["arch"] == "vit" and r["size"] == "quick" and r["steps"] == STEPS
        assert r["seeds"] == list(range(r["n_models"])) and len(r["parent_losses"]) == r["n_models"]
        assert r["mean_parent_loss"] == pytest.approx(sum(r["parent_losses"]) / r["n_models"])
        assert math.isfinite(r["loss_merged"])
        assert r["barrier"] == pytest.approx(r["loss_merged"] - r["mean_parent_loss"])
        assert r["seconds"] > 0
        if r["mode"] == "universe":
            assert r["align"] == "weights" and 1 <= r["rounds"] <= 3
            assert len(r["changed"]) == r["rounds"] and isinstance(r["converged"], bool)
            assert r["converged"] == (r["changed"][-1] == 0)
            assert r["stopped"] == ("converged" if r["converged"] else "max_rounds")
            assert 0 <= r["spread"] and 0 <= r["spread_anchor"]
        else:
            assert r["rounds"] is None and r["converged"] is None
            assert r["align"] == (None if r["mode"] == "vanilla" else "weights")
    # the same N models and parents in every mode
    for n in (2, 3):
        parents = {tuple(r["parent_losses"]) for r in records if r["n_models"] == n}
        assert len(parents) == 1


def test_markdown_and_plots(records, tmp_path):
    md = bench_universe.markdown(records)
    assert md.startswith("# N models: anchor vs universe")
    wins = sum(by["universe"]["barrier"] < by["anchor"]["barrier"] for by in bench_universe._table(records).values())
    assert f"lower barrier in {wins} of 2 rows" in md
    lines = md[md.index("| arch | N |"):].strip().splitlines()
    assert len(lines) == 2 + 2  # header, rule, N=2, N=3
    assert lines[2].startswith("| vit | 2 |") and lines[3].startswith("| vit | 3 |")
    by = {(r["n_models"], r["mode"]): r for r in records}
    assert f"{by[(3, 'universe')]['barrier']:+.4f}" in lines[3]
    files = bench_universe.plot(records, tmp_path)
    assert files == ["universe_barrier.png", "universe_rounds.png"]
    for f in files:
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

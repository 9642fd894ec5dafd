"""benchmarks.bench_cnn on a toy setting: 2 seeds trained 30 steps into a temporary cache, one
pair, BatchNorm statistics reset on 512 training images."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import suite as runner
from benchmarks import bench_cnn
from benchmarks.provenance import jsonable

pytestmark = pytest.mark.slow  # trains 2 CNNs in its fixture (~10 s of CPU)

STEPS = 30
METHODS = ["vanilla", "vanilla+repair", "weights", "weights+repair", "activations",
           "activations+repair"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("cache")
    mp.setenv("SYMGRAPH_CACHE", str(cache))
    mp.setenv("SYMGRAPH_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = bench_cnn.run("quick", (0, 1), steps=STEPS, reset_images=512, verbose=False)
        cached = sorted(p.name.split("-steps")[0] for p in (cache / "models").iterdir())
        again, _ = bench_cnn.train_cnn(1, "quick", STEPS)  # from the cache
    finally:
        mp.undo()
        torch.set_num_threads(threads)
    return res, cached, again


def test_records(result):
    res, cached, again = result
    assert cached == ["cnn-quick-seed0", "cnn-quick-seed1"]
    recs = res["records"]
    assert [r["method"] for r in recs] == METHODS and all(r["pair"] == [0, 1] for r in recs)
    st = res["settings"]
    assert st["steps"] == STEPS and st["reset_images"] == 512 and st["eval_images"] == 180
    assert set(res["models"]) == {"0", "1"} and all(m["accuracy"] > 0.5 for m in res["models"].values())
    for r in recs:
        losses = [l for _, l in r["curve"]]
        assert [x for x, _ in r["curve"]] == [x for x, _ in r["acc_curve"]]
        assert len(losses) == 21 and r["curve"][0][0] == 0.0 and r["curve"][-1][0] == 1.0
        assert r["barrier"] == pytest.approx(max(losses) - 0.5 * (r["loss_a"] + r["loss_b"]))
        assert r["loss_mid"] == losses[10] and r["acc_mid"] == r["acc_curve"][10][1]
        accs = [a for _, a in r["acc_curve"]]
        assert r["acc_drop"] == pytest.approx(0.5 * (r["acc_a"] + r["acc_b"]) - min(accs))
        assert r["loss_b_aligned"] == pytest.approx(r["loss_b"], abs=1e-5)  # exact permutations
        if r["repair"]:
            # the library's merge(..., repair=True) gives the curve's repaired midpoint
            assert r["merge_loss_mid"] == pytest.approx(r["loss_mid"], abs=1e-4)
            assert [b["name"] for b in r["batchnorm"]] == ["bn1", "bn2", "bn3"]
            assert all(b["std_ratio"] < 1 for b in r["batchnorm"])  # the variance collapse
        else:  # no reset: the curve's ends are the parents themselves
            assert losses[-1] == pytest.approx(r["loss_a"], abs=1e-6)
            assert losses[0] == pytest.approx(r["loss_b"], abs=1e-5)
            assert r["barrier"] == pytest.approx(r["barrier_curve"], abs=1e-5)
    loss_1 = bench_cnn.evaluate(again, bench_cnn._eval_batches())[0]  # B, reloaded
    assert loss_1 == pytest.approx(recs[0]["loss_b"], abs=1e-6)


def test_alignment_and_repair_lower_the_barrier(result):
    """Measured (1 thread): barriers vanilla 1.69, + REPAIR 1.15; weights 1.40, + REPAIR 0.46;
    activations 1.28, + REPAIR 0.32."""
    by = {r["method"]: r for r in result[0]["records"]}
    assert by["weights"]["barrier"] < by["vanilla"]["barrier"] - 0.1
    assert by["activations"]["barrier"] < by["vanilla"]["barrier"] - 0.1
    for m in ("vanilla", "weights", "activations"):
        assert by[m + "+repair"]["barrier"] < by[m]["barrier"] - 0.2, m
        assert by[m + "+repair"]["acc_mid"] > by[m]["acc_mid"], m


def test_report_from_the_json(result, tmp_path):
    res = json.loads(json.dumps(jsonable(result[0])))  # what results.json holds
    md = bench_cnn.markdown(res)
    assert md.startswith("# CNN with BatchNorm on digits")
    by = {r["method"]: r for r in res["records"]}
    for m in METHODS:
        row = next(line for line in md.splitlines() if line.startswith(f"| {m} |"))
        assert f"{by[m]['barrier']:.4f}" in row and f"{by[m]['acc_mid']:.4f}" in row
    assert "| 0-1 |" in md
    assert bench_cnn.plot(res, tmp_path) == ["cnn_curves.png"]
    assert (tmp_path / "cnn_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(math.isfinite(r["barrier"]) for r in res["records"])


def test_suite_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(runner, "run", lambda *a, **kw: seen.update(kw))
    runner.main(["--quick", "--no-cnn"])
    assert seen["cnn"] is False
    runner.main(["--quick"])
    assert seen["cnn"] is True

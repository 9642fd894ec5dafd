"""Distributed statistics (:mod:`symgraph.core.distributed`): two ``torchrun`` processes (gloo, CPU)
each measure their own shard of the batches; activation statistics, Fisher and RegMean
statistics, the alignment and a merge (RegMean, REPAIR) equal one process's on all the
batches, and are the same on both ranks. The helpers' key-union, dtype and refusal
behaviour is checked in the same run (tests/dist_worker.py)."""
from __future__ import annotations

import pytest
import torch

import dist_worker
from dist_helpers import two_ranks
from symgraph.core import distributed
from symgraph.alignment.activations import ActStats, all_reduce_stats


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two processes wrote: ``[rank 0's, rank 1's]``."""
    return two_ranks("dist_worker.py", tmp_path_factory.mktemp("dist"))


def _same(x, y, rtol):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
        if rtol == 0 or not x.is_floating_point():
            return torch.equal(x, y)
        scale = y.abs().max().clamp_min(1e-300)  # relative to the tensor's size
        return bool(((x - y).abs() <= rtol * scale).all())
    return x == y


@pytest.mark.slow
def test_helpers_across_two_processes(ranks):
    for r, got in enumerate(x["helpers"] for x in ranks):
        assert got["active"] and got["rank"] == r and got["world"] == 2
        assert got["shard"] == [[0, 2, 4], [1, 3]][r]
        assert got["sum_same"] and got["sum"].dtype == torch.float32
        assert torch.equal(got["sum"], torch.full((3,), 3.0))
        # the union of the keys, sorted; missing keys as zeros of the other rank's shape/dtype
        assert got["dict_keys"] == ["a", "n", "only0", "only1"]
        for d in (got["dict"], got["dict_small_buckets"]):
            assert torch.equal(d["a"], torch.arange(4, dtype=torch.float64).reshape(2, 2) * 3)
            assert d["n"] == 7 and type(d["n"]) is int
            assert d["only0"].dtype == torch.float32 and torch.equal(d["only0"], torch.ones(2, 3))
            assert d["only1"].dtype == torch.int64 and torch.equal(d["only1"], torch.tensor([7, 8]))
        assert got["dict_untouched"]
        # a class observed on rank 0 only: rank 1 ends with rank 0's sums
        s0, s = ranks[0]["helpers"]["act_one_rank"], got["act_one_rank"]
        assert s["n"] == 6 and all(torch.equal(s[f], s0[f]) for f in ("sa", "sb", "saa", "sbb", "sab"))
        assert s["sab"].shape == (1, 1, 4, 4)
        assert "statistic 'x'" in got["mismatch"] and "rank 1" in got["mismatch"]


def test_statistics_equal_one_process_on_all_data(ranks):
    """Every sum, count and solved value of the two shards (3 and 2 batches) is one process's
    on all 5 batches (relative 1e-6), and both ranks hold bit-identical results."""
    A, B, batches = dist_worker.setup()
    torch.set_num_threads(1)
    want = dist_worker.compute(A, B, batches)
    got, other = ranks[0]["stats"], ranks[1]["stats"]
    assert set(got) == set(want) == set(other)
    for prefix in ("act.", "fisher.", "regmean.", "align.", "merged.", "repair.", "repaired."):
        assert any(k.startswith(prefix) for k in want), prefix
    assert sum(1 for k in want if k.startswith("align.")) >= 4
    assert any(k.endswith(".n") and want[k] > 0 for k in want)
    bad = [k for k in want if not _same(got[k], want[k], 1e-6)]
    assert not bad, bad[:10]
    assert all(_same(got[k], other[k], 0) for k in want)  # every rank: the same results
    # the solves did not come out equal by having nothing to do: B is permuted, A is not B
    assert not all(torch.equal(v, torch.arange(len(v))) for k, v in want.items()
                   if k.startswith("align.") and v.dim() == 1 and not v.is_floating_point())


def test_single_process_is_a_no_op():
    """Without a process group every helper returns its input untouched."""
    assert not distributed.is_active() and distributed.rank() == 0 and distributed.world_size() == 1
    t = torch.arange(3.0)
    assert distributed.all_reduce_sum(t) is t and torch.equal(t, torch.arange(3.0))
    d = {"a": t, "n": 2}
    assert distributed.all_reduce_dict(d) is d
    assert distributed.shard([1, 2, 3]) == [1, 2, 3]
    s = ActStats()
    s.add(torch.ones(4, 2, dtype=torch.float64), torch.ones(4, 2, dtype=torch.float64), 0)
    sab = s.sab
    assert s.all_reduce() is s and s.n == 4 and s.sab is sab
    stats = {0: s}
    assert all_reduce_stats(stats) is stats

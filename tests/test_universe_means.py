"""A shared universe's means (:meth:`~symgraph.merging.streaming.StreamingMerge.averaging`) are
carried and combined in float64 and rounded once, as the in-memory universe once computed them,
wherever a piece's float64 copies fit in what the memory budget leaves beside everything the
ledger holds (the parent merge's bytes too); a piece that does not fit is computed in the work
dtype (float32), and the ledger never holds more than the budget."""
from __future__ import annotations

import copy

import pytest
import torch

from symgraph.checkpoints.memory import ModelCheckpoint
from symgraph.checkpoints.sharded import parse_size
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing.models import build

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
W = [0.25, 0.75]
GATE = "model.layers.0.mlp.gate_proj.weight"  # its norm fold's group: 3 float64 copies are 74.5 kB
ALONE = "model.layers.0.mlp.down_proj.weight"  # merged alone: 3 float64 copies are 36.9 kB


@pytest.fixture(scope="module")
def pair():
    ms = [build("llama", seed=s, **L) for s in range(2)]
    return ms, [ModelCheckpoint(m, f"model {i}") for i, m in enumerate(ms)]


def _mean(pair, budget=None, parent_holds=0):
    """The mean with weights ``W`` of the pair aligned by weights (``budget``: the merge's memory
    budget; ``parent_holds``: bytes the parent's ledger holds while the mean is written), its
    merged tensors, the float64 mean rounded once to float32 (``exact``) and the ledger's peak."""
    ms, ckpts = pair
    job = StreamingMerge(ckpts, align="weights", memory_budget=budget)
    al = job.align()[1]
    moved = al.apply(copy.deepcopy(ms[1]).double()).state_dict()
    a = ms[0].state_dict()
    exact = {k: (W[0] * a[k].double() + W[1] * moved[k]).float() for k in a if a[k].is_floating_point()}
    mean = job.averaging([0, 1], W)
    mean.use(job.report, job.alignments)
    ledger = mean.resources.ledger
    ledger.hold(parent_holds)
    ledger.peak = ledger.now
    parts: dict = {}
    mean.write_into(lambda k, t: parts.setdefault(k, []).append(t))  # a large tensor: its rows in slices
    assert ledger.now == parent_holds  # every byte the mean held dropped
    return {k: torch.cat(ts) for k, ts in parts.items()}, exact, ledger.peak


def test_without_a_budget_every_mean_is_float64_rounded_once(pair):
    got, exact, _ = _mean(pair)
    assert got.keys() >= exact.keys()
    differ = [k for k in exact if not torch.equal(got[k], exact[k])]
    assert not differ, differ  # bit for bit, every tensor (float32 carries differ in ~14k entries)


def test_within_a_budget_a_piece_is_float64_where_its_copies_fit(pair):
    budget = parse_size("64KB")
    got, exact, peak = _mean(pair, "64KB")
    assert 0 < peak <= budget
    assert torch.equal(got[ALONE], exact[ALONE]) and torch.equal(got["lm_head.weight"], exact["lm_head.weight"])
    assert not torch.equal(got[GATE], exact[GATE])  # 74.5 kB in float64: carried in float32
    assert float((got[GATE] - exact[GATE]).abs().max() / exact[GATE].abs().max()) < 1e-6


def test_the_parents_bytes_leave_the_mean_less_room(pair):
    """What the parent holds counts: at 128 kB the group of ``GATE`` (74.5 kB in float64) is
    float64 alone, and float32 (37.2 kB) beside 64 kB the parent holds, the ledger within the
    budget either way."""
    budget = parse_size("128KB")
    got, exact, peak = _mean(pair, "128KB")
    assert 0 < peak <= budget and torch.equal(got[GATE], exact[GATE])
    got, exact, peak = _mean(pair, "128KB", parent_holds=64_000)
    assert peak <= budget and not torch.equal(got[GATE], exact[GATE])
    assert float((got[GATE] - exact[GATE]).abs().max() / exact[GATE].abs().max()) < 1e-6

"""The merge engine runs a merge as its steps (``symgraph/merging/engine/steps.py``): each timed
under its name; a shared universe is a step of the alignment; what the writing reads is
prepared (statistics, REPAIR) before any output exists, and freed after it is written."""
from __future__ import annotations

import os

import pytest
import torch

import symgraph
from symgraph.checkpoints.memory import ModelCheckpoint
from symgraph.merging.engine.sums import Spill
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing.models import build

from engine_helpers import load

KW = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def models():
    return [build("llama", seed=s, **KW) for s in (0, 1, 2)]


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    for i, m in enumerate(models[:2]):
        m.save_pretrained(root / f"m{i}", safe_serialization=True)
    return root


def _data():
    ids = torch.randint(0, KW["vocab"], (8, 12), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]


def test_the_universe_is_a_step_of_the_alignment(models):
    """``align()`` of a job anchored at the universe runs its rounds after round 0: the record is
    the job's, every step is timed, and it equals ``symgraph.merge``'s rounds."""
    ckpts = [ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models)]
    job = StreamingMerge(ckpts, anchor="universe", universe={"max_rounds": 2})
    alignments = job.align()
    rec = job.universe
    assert rec["rounds"] >= 1 and rec["max_rounds"] == 2 and len(rec["round_seconds"]) == rec["rounds"] + 1
    assert {"analyze", "align", "universe"} <= set(job.timings)
    assert all(al is not None for al in alignments[1:])
    ref = symgraph.merge(models, anchor="universe", universe_options={"max_rounds": 2})
    assert ref.universe["changed"] == rec["changed"]


def test_an_anchor_runs_no_rounds(models):
    job = StreamingMerge([ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models[:2])])
    job.align()
    assert job.universe is None and "universe" not in job.timings


def test_prepare_takes_the_statistics_once_before_any_output(saved, tmp_path):
    """RegMean's Grams are taken by ``prepare`` into a spill in the scratch directory, REPAIR's
    report exists before anything is written, a second ``prepare`` takes nothing again, and
    ``write`` removes the spill; the merge equals one written without a separate prepare."""
    paths = [str(saved / "m0"), str(saved / "m1")]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    job = StreamingMerge(paths, method="regmean", repair=True, data=_data(), scratch=str(scratch))
    job.prepare()
    spills = [p for p in os.listdir(scratch) if p.startswith(Spill.PREFIX)]
    assert len(spills) == 1 and job.repair_report is not None and job.repair_report.layers
    taken, seconds = job.statistics.per_model, job.timings["statistics"]
    job.prepare()
    assert job.statistics.per_model is taken and job.timings["statistics"] == seconds
    (tmp_path / "a").mkdir()
    job.write(str(tmp_path / "a"))
    assert [p for p in os.listdir(scratch) if p.startswith(Spill.PREFIX)] == []
    again = StreamingMerge(paths, method="regmean", repair=True, data=_data())
    (tmp_path / "b").mkdir()
    again.write(str(tmp_path / "b"))
    a, b = load(tmp_path / "a"), load(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unaligned_circuit_heads_read_the_analyze_steps_report(models):
    """Circuit-space heads without alignment: the Analyze step analyses the anchor (the transform
    never does) and the heads come out twice as wide."""
    ckpts = [ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models[:2])]
    job = StreamingMerge(ckpts, align=None, attention="circuits")
    job.align()
    assert job.graph_report is not None and job.report is None  # analysed, not aligned
    got = {}
    job.write_into(lambda k, t: got.__setitem__(k, t))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert got[q].shape[0] == 2 * models[0].state_dict()[q].shape[0]

"""Squared gradients out of core (:mod:`symgraph.merging.engine.gradients`): the traced graph cut into
segments and differentiated one segment at a time gives the statistic the loaded model gives
(Fisher's, the brute-force reference of ``statistics_reference``), whatever the budget; each
segment holds at most the budget of weights; a tied weight's batch gradient is summed over
the segments that read it before it is squared."""
from __future__ import annotations

import pytest
import torch

import statistics_reference
from symgraph.checkpoints.specs import load_local
from symgraph.merging.engine.gradients import plan_segments, squared_gradients
from symgraph.merging.engine.statistics import StatisticsContext
from symgraph.merging.methods.fisher import Fisher
from symgraph.merging.engine.sums import Spill
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bp")
    for i in range(2):
        models.build("llama", seed=i, tie_word_embeddings=True, **SIZES).save_pretrained(str(d / f"m{i}"))
    return d


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (4, 12), generator=g)} for _ in range(3)]


def _stats(job, i, tmp_path):
    """Model ``i``'s squared gradients out of core, as the engine takes Fisher's statistic."""
    job.spill = Spill(str(tmp_path))
    try:
        st = squared_gradients(StatisticsContext.of(job), i, Fisher.statistic, f"f/{i}/")
        return {k: st[k].clone() for k in st}
    finally:
        job.spill.close()


def _loaded(job, i):
    """Model ``i``'s Fisher of the loaded model in the anchor's basis (the reference)."""
    al = job.alignments[i]
    rep = al.report_b if al is not None else job.graph_report
    stat = statistics_reference.in_anchor_basis(Fisher.statistic, load_local(job.checkpoints[i].path), rep, al,
                                                job.graph_report, job.data)
    A = job.checkpoints[job.anchor]
    return {alias: v for k, v in stat.items() for alias in {k, *A.params.get(k, ())}}  # every name of a tied one


@pytest.mark.parametrize("align", ["none", "weights"])
def test_segments_give_the_loaded_models_squared_gradients(pair, tmp_path, align):
    """For the anchor and the aligned model (norm gains folded: measured on the aligned model),
    segments of a few KB of weights and one segment for the whole graph give the whole
    loaded model's Fisher (float32 models: to 1e-5 of each tensor's largest entry; the same
    ops in the same order give the same sums up to the order autograd adds partial gradients)."""
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], method="fisher", data=_data(), align=align)
    job.align()
    for i in (0, 1):
        ref = _loaded(job, i)
        assert len(ref) >= 20 and all(v.dtype == torch.float64 for v in ref.values())
        for budget in (4 << 10, 1 << 30):
            job.resources.stats_bytes = budget
            got = _stats(job, i, tmp_path)
            assert set(got) == set(ref)
            for k, v in ref.items():
                assert v.abs().max() > 0, k
                err = float((got[k] - v).abs().max() / v.abs().max())
                assert err < 1e-5, (i, budget, k, err)


def test_segment_plan_respects_the_budget_and_cuts_between_layers(pair):
    """Each segment reads at most the budget of weights unless one op reads more; the cuts
    are placed where few activation bytes cross (a cut carries no more than a few residual
    streams); a budget above the model gives one segment."""
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], method="fisher", data=_data(), align="none")
    job.align()
    gm = job.graph_report.exported_program.module()
    named = dict(gm.named_parameters(remove_duplicate=False))
    cost = {n: t.numel() * t.element_size() for n, t in named.items()}
    order = list(gm.graph.nodes)
    assert plan_segments(gm, cost, 1 << 30) == [(0, len(order))]
    budget = 3 * 32 * 48 * 4  # one MLP's weights: about a third of a layer
    segs = plan_segments(gm, cost, budget)
    assert len(segs) >= 4 and segs[0][0] == 0 and segs[-1][1] == len(order)
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    for a, b in segs:
        reads = [cost[x.target] for n in order[a:b] for x in n.all_input_nodes
                 if x.op == "get_attr" and x.target in cost]
        assert sum(reads) <= budget or len(reads) == 1 or max(reads) > budget, (a, b, reads)

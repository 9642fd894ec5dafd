"""Exact recovery of the full groups on 22 families no per-model code names: a
``random_transform(seed=0)`` of the model (full groups: GL per head on QK and VO, RoPE's scaled
rotations, ReLU's scaled permutations, not only their orthogonal part) merged back into it by
weights and by activations with ``full_groups=True`` (Hugging Face classes built from tiny
configs; the eight of ``symgraph.testing.models`` plus fourteen more: ``benchmarks.families``,
which the provenance benchmark compares too)."""
from __future__ import annotations

import pytest
import torch

import symgraph
from benchmarks.families import FAMILIES, MORE, batches, build


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation
    yield
    torch.set_num_threads(n)


def _rel(A, B) -> float:
    num = sum(float((p.detach().double() - q.detach().double()).norm() ** 2) for p, q in zip(A.parameters(), B.parameters()))
    return (num / sum(float(p.detach().double().norm() ** 2) for p in A.parameters())) ** 0.5


def _batches(A, n=3):
    return batches(A, n)


# the two slowest families (20-28 s each) run with -m slow; the default suite took 747 s at 29a92d8 (budget 600 s)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("phi3", "falcon") else n
                                  for n in FAMILIES])
@pytest.mark.slow
def test_a_transformed_copy_merges_back_by_weights_and_activations(name):
    A = build(name)
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, (name, "weights" if data is None else "activations")


def test_roberta_gathers_token_types_without_freezing():
    """RoBERTa gathers its token types by position ids (``torch.gather`` on a buffer): the
    gather rule leaves nothing frozen."""
    A = MORE["roberta"]().eval()
    rep = symgraph.analyze(A)
    assert rep.frozen == [] and rep.certify(A) < 1e-6


def test_falcon_multi_query_has_head_classes():
    """Falcon's multi-query split (``qkv.view(..., heads + 2, d)[..., :-2, :]``, ``[..., [-2], :]``,
    ``[..., [-1], :]``): the packed axis is a sum of the query heads, the key head and the value
    head (literal index lists read as ranges), so the query heads are a class, the shared key
    head's RoPE rotation one element for all of them, and the shared value head a GL class of its
    own (one element, its inverse on every head's block of the output projection)."""
    A = MORE["falcon"]().eval()
    rep = symgraph.analyze(A)
    attn = [(g.kind, g.size, g.blocks) for g in rep.groups if g.module.endswith("self_attention")]
    assert ("perm", 4, 1) in attn and ("gl", 8, 1) in attn
    assert [(g.kind, g.size) for g in rep.groups if g.module.endswith("query_key_value")] == [("rope", 8)] * 2
    assert rep.frozen == [] and rep.certify(A) < 1e-6


def test_modernbert_packed_qkv_has_qk_and_vo_classes_per_head():
    """ModernBERT packs Q, K and V as ``Wqkv(x).view(b, s, 3, H, d).unbind(dim=-3)``: the packed
    axis is a sum of three ``H × d`` parts, so each head gets a RoPE class on QK and a GL class
    on VO, as in separate projections (one shared class for Q, K and V before)."""
    A = MORE["modernbert"]().eval()
    rep = symgraph.analyze(A)
    kinds = sorted((g.kind, g.size, g.blocks) for g in rep.groups if ".attn" in g.module)
    assert kinds == sorted([("perm", 4, 1), ("gl", 32, 4), ("rope", 32, 4)] * 2)
    assert rep.frozen == [] and rep.certify(A) < 1e-6

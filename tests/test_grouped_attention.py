"""Grouped 1-D convolutions inside attention (issue 65, SqueezeBERT): a grouped convolution's
outputs inside a group take a map per group (a product groups × per_group, every tensor saying
which group); a class fibred over classes that do not form a chain keeps its inner part (the
head dims over the heads, not over the groups of heads too). Certified in float64, and a
transformed copy recovered by weight matching."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def recovered(model, report, inputs, seed=3):
    moved = symgraph.transform(model, report.random_transform(seed=seed, orthogonal=True))
    al = symgraph.align(model, moved, inputs)
    got, want, was = al.apply(moved).state_dict(), model.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    return max((got[k] - want[k]).abs().max().item() for k in want)


class Grouped1d(nn.Module):
    def __init__(self, g1, g2):
        super().__init__()
        self.a, self.b = nn.Conv1d(6, 16, 1), nn.Conv1d(16, 32, 1, groups=g1)
        self.c, self.fc = nn.Conv1d(32, 16, 3, groups=g2), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.c(F.gelu(self.b(F.gelu(self.a(x))))).mean(2))


@pytest.mark.parametrize("g1,g2", [(4, 2), (1, 2), (4, 4)])
def test_grouped_conv1d_outputs_per_group(g1, g2):
    m = randomized(Grouped1d(g1, g2))
    x = (torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64),)
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < 1e-12
    (out,) = [g for g in r.groups if ("c.bias", 0) in g.params and g.kind == "gl"]
    # c's outputs inside a group: one map per group, fibred over c's groups
    assert (out.size, out.dim, out.blocks) == (16, 16 // g2, g2) and r.fibre_shape(out.id) == (g2,)
    (groups,) = r.fibre_groups(out.id)
    assert r.groups[groups].kind == "perm" and ("c.weight", 0) in r.groups[groups].params
    t = r.random_transform(seed=1)
    E = t.elements[out.id]
    assert E.shape == (g2, 16 // g2, 16 // g2) and (E[0] - E[1]).abs().max() > 0.1
    assert recovered(m, r, x) < 1e-9


def squeezebert():
    cfg = transformers.SqueezeBertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=32, embedding_size=16, q_groups=2, k_groups=2, v_groups=2,
        post_attention_groups=2, intermediate_groups=4, output_groups=2)
    return randomized(transformers.SqueezeBertForSequenceClassification(cfg))


def test_squeezebert_grouped_attention():
    m = squeezebert()
    x = {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < 1e-12
    layer = "transformer.encoder.layers.0"
    q = r.group_of(f"{layer}.attention.query.weight", 0)
    assert r.group_of(f"{layer}.attention.key.weight", 0) == q
    # query channels: q's 2 groups (the stream's outer factor) × 2 heads per group × 4 dims
    assert r.axis_structure(r.param_axes(f"{layer}.attention.query.weight")[0]) == ("prod", [2, 2, 4])
    (qk,) = [g for g in q if g.kind == "gl"]
    heads = r.groups[r.fibre_groups(qk.id)[0]]
    assert (qk.dim, qk.blocks, heads.kind, heads.size) == (4, 2, "perm", 2)  # QK per head
    (vo,) = [g for g in r.group_of(f"{layer}.attention.value.weight", 0) if g.kind == "gl"]
    assert vo != qk and (f"{layer}.post_attention.conv1d.weight", 1) in vo.params
    # the intermediate conv's outputs (4 groups of 8; the output conv reads them in 2 groups):
    # a permutation per group
    (mid,) = [g for g in r.group_of(f"{layer}.intermediate.conv1d.weight", 0) if g.outer]
    assert (mid.kind, mid.dim, mid.blocks) == ("perm", 8, 2)
    assert recovered(m, r, x) < 1e-9

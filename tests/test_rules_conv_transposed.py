"""Transposed convolutions (``ConvTranspose2d``: a learned upsampling, LowFormer's attention
branch, U-Nets' decoders): the weight is ``[G·I, O, *k]``, so its dim 0 reads the input
channels (contravariant) and dim 1 writes the output channels; grouped ones keep whole groups
together, each group's inputs taking a map of their own and its outputs one map for every
group; depthwise ones make input and output one class. Mapping, certificate, and a permuted
copy recovered by weight matching.
"""
from __future__ import annotations

import pytest
import torch

import symgraph

from function_helpers import assert_recovered
from rules_helpers import B, analyze, structure, summary, x_of


class Up(torch.nn.Module):
    """conv -> relu -> transposed conv (stride 2) -> relu -> conv -> mean -> linear."""

    def __init__(self, groups, mid, out):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, mid, 1)
        self.ct = torch.nn.ConvTranspose2d(mid, out, 4, stride=2, padding=1, groups=groups)
        self.c3 = torch.nn.Conv2d(out, 4, 1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.ct(torch.relu(self.c1(x))))
        return self.fc(self.c3(h).mean(dim=(2, 3)))


C1 = {("c1.weight", 0), ("c1.bias", 0)}
C3 = ("gl", 4, 1), {("c3.weight", 0), ("c3.bias", 0), ("fc.weight", 1)}


def test_transposed_conv_reads_dim_0_and_writes_dim_1():
    r = analyze(Up(1, 6, 5), x_of(B, 2, 5, 5))
    assert summary(r) == {("scaled_perm", 6, 1): C1 | {("ct.weight", 0)},
                          ("scaled_perm", 5, 1): {("ct.weight", 1), ("ct.bias", 0), ("c3.weight", 1)},
                          C3[0]: C3[1]}
    assert r.frozen == []


def test_depthwise_transposed_conv_is_one_permutation_class():
    r = analyze(Up(6, 6, 6), x_of(B, 2, 5, 5))
    assert summary(r) == {("perm", 6, 1): C1 | {("ct.weight", 0), ("ct.bias", 0), ("c3.weight", 1)},
                          C3[0]: C3[1]}
    assert r.frozen == []


def test_grouped_transposed_conv_inputs_per_group_outputs_shared():
    r = analyze(Up(3, 6, 9), x_of(B, 2, 5, 5))  # 3 groups: 2 -> 3 channels each
    assert structure(r, "ct.weight", 0) == ("prod", [3, 2])
    assert structure(r, "ct.bias", 0) == ("prod", [3, 3])
    assert summary(r) == {
        ("perm", 3, 1): C1 | {("ct.weight", 0), ("ct.bias", 0), ("c3.weight", 1)},
        ("scaled_perm", 6, 3): C1 | {("ct.weight", 0)},  # a map per group on its inputs
        ("scaled_perm", 3, 1): {("ct.weight", 1), ("ct.bias", 0), ("c3.weight", 1)},  # one for all
        C3[0]: C3[1]}


@pytest.mark.parametrize("groups,mid,out", [(1, 6, 5), (6, 6, 6), (3, 6, 9)])
def test_permuted_copy_recovered_by_weights(groups, mid, out):
    x = x_of(B, 2, 5, 5)
    model = Up(groups, mid, out)
    report = analyze(model, x)
    t = report.random_transform(seed=3, orthogonal=True)
    moved = symgraph.transform(model, t)
    with torch.no_grad():
        assert torch.allclose(moved(x), model(x), atol=1e-5)
        assert not torch.equal(moved.ct.weight, model.ct.weight)
    assert_recovered(model, moved, (x,))

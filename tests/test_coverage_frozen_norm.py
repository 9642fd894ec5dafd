"""A frozen batch norm (DETR's backbone: four buffers combined elementwise into a per-channel
scale and shift) moves its buffers with the channel class (``symgraph.passes.bufferviews``);
a table varying along two axes read by a product (rotary ``cos``) stays fixed."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import symgraph


class FrozenNorm(torch.nn.Module):
    """As DETR's and RT-DETR's frozen batch norm: statistics and affine maps as buffers."""

    def __init__(self, n):
        super().__init__()
        g = torch.Generator().manual_seed(n)
        for name, shift in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.5)):
            self.register_buffer(name, shift + 0.5 * torch.rand(n, generator=g))

    def forward(self, x):
        w, b = self.weight.reshape(1, -1, 1, 1), self.bias.reshape(1, -1, 1, 1)
        rv, rm = self.running_var.reshape(1, -1, 1, 1), self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + 1e-5).rsqrt()
        return x * scale + (b - rm * scale)


class Net(torch.nn.Module):
    def __init__(self, table: bool = False):
        super().__init__()
        self.c1, self.n1 = torch.nn.Conv2d(3, 8, 3, padding=1), FrozenNorm(8)
        self.c2, self.n2 = torch.nn.Conv2d(8, 8, 3, padding=1), FrozenNorm(8)
        self.head = torch.nn.Linear(8, 2)
        self.table = table
        self.register_buffer("cos", torch.rand(8, 5, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):  # [batch, 3, 5, 5]
        h = torch.relu(self.n1(self.c1(x)))
        h = torch.relu(self.n2(self.c2(h)))
        if self.table:
            h = h * self.cos.reshape(1, 8, 1, 5)
        return self.head(h.mean((2, 3)))


def _model(table=False):
    torch.manual_seed(0)
    return Net(table).double().eval(), (torch.randn(2, 3, 5, 5, dtype=torch.float64),)


def test_frozen_norm_buffers_move_with_the_channels():
    m, x = _model()
    r = symgraph.analyze(m, x)
    assert r.fixed_buffers == {"cos": "not read by the graph"}  # every norm buffer moves
    (first,) = r.group_of("c1.weight", 0)
    (second,) = r.group_of("c2.weight", 0)
    assert first.kind == second.kind == "perm" and first.id != second.id
    assert {("n1.weight", 0), ("n1.running_var", 0), ("n1.running_mean", 0), ("n1.bias", 0)} <= set(first.buffers)
    assert ("c2.weight", 1) in first.params and ("head.weight", 1) in second.params
    assert r.certify(m, x) < 1e-12
    moved = symgraph.transform(m, r.random_transform(seed=0))
    assert not torch.equal(moved.n1.running_var, m.n1.running_var)
    assert sorted(moved.n1.running_var.tolist()) == pytest.approx(sorted(m.n1.running_var.tolist()))
    assert torch.allclose(moved(*x), m(*x), atol=1e-12)


def test_table_along_two_axes_read_by_a_product_stays_fixed():
    m, x = _model(table=True)
    r = symgraph.analyze(m, x)
    assert list(r.fixed_buffers) == ["cos"]
    assert r.group_of("c2.weight", 0) == []  # the table fixes the second conv's channels
    assert r.certify(m, x) < 1e-12


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm installed: its backbone is kept")
@pytest.mark.slow
def test_detr_backbone_complete_without_inputs():
    from benchmarks import coverage as cov
    r = cov.run_family("detr", "DetrForObjectDetection", "object_detection")
    assert r["error"] is None and r["certificate"] <= 1e-6 and r["sound"]
    assert r["complete"] and r["structure"]["missing"] == []
    assert r["structure"]["mlps"] >= 8  # the ResNet backbone's bottlenecks, now with their classes

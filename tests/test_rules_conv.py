"""Per-op rules, checked through tiny modules: convolutions, BatchNorm and its running
statistics, buffers read without a rule, pooling, grouped and depthwise convolutions.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import symgraph

from rules_helpers import B, analyze, structure, summary, x_of


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(2, 5, 3, padding=1), torch.nn.Conv2d(5, 4, 3)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.c2(torch.relu(self.c1(x)))).mean(dim=(2, 3)))


def test_conv_channels():
    r = analyze(Conv(), x_of(B, 2, 6, 6))
    assert summary(r) == {
        ("scaled_perm", 5, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)},
        ("signed_perm", 4, 1): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}


def _bn_stats(mod):
    """Random running statistics (the defaults, zeros and ones, hide a wrong slot)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in mod.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(m.running_var.shape, generator=g))
    return mod.eval()


class ConvBN(torch.nn.Module):
    """conv -> batch norm -> relu -> conv, the norm as ``how`` spells it."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.c1, self.c2 = torch.nn.Conv2d(2, 5, 3, padding=1), torch.nn.Conv2d(5, 4, 3)
        self.bn = torch.nn.BatchNorm2d(5, track_running_stats=how != "batch_stats")
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h, bn = self.c1(x), self.bn
        if self.how == "native":
            h = torch.ops.aten._native_batch_norm_legit_no_training(
                h, bn.weight, bn.bias, bn.running_mean, bn.running_var, 0.1, 1e-5)[0]
        else:  # nn.BatchNorm2d: aten.batch_norm (eval) or batch statistics
            h = bn(h)
        return self.fc(self.c2(torch.relu(h)).mean(dim=(2, 3)))


@pytest.mark.parametrize("how", ["module", "native", "batch_stats"])
def test_batch_norm_channels_and_running_stats(how):
    m = _bn_stats(ConvBN(how))
    r = analyze(m, x_of(B, 2, 6, 6))
    bn = {("bn.weight", 0), ("bn.bias", 0)}
    assert summary(r) == {
        ("perm", 5, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)} | bn,
        ("gl", 4, 1): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}
    stats = [] if how == "batch_stats" else ["bn.running_mean", "bn.running_var"]
    assert r.buffers == stats and r.groups[0].buffers == [(b, 0) for b in stats]
    if stats:
        assert r.fixed_buffers == {"bn.num_batches_tracked": "not a floating-point tensor"}
        t = r.random_transform(seed=1)
        moved = symgraph.transform(m, t)
        idx = t.elements[r.groups[0].id].index
        for b in stats:  # the buffers move with the channels
            assert torch.equal(moved.get_buffer(b), m.get_buffer(b)[idx]), b
    assert r.frozen == []


class ReadStats(torch.nn.Module):
    """A running mean also read outside the batch norm (by a view: a constant op)."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.fc = torch.nn.Conv2d(2, 5, 1), torch.nn.BatchNorm2d(5), torch.nn.Linear(5, 3)

    def forward(self, x):
        h = self.bn(self.c1(x)) + self.bn.running_mean.view(1, -1, 1, 1)
        return self.fc(h.mean(dim=(2, 3)))


def test_buffer_read_without_a_rule_is_fixed():
    r = analyze(_bn_stats(ReadStats()), x_of(B, 2, 4, 4))
    assert r.buffers == [] and r.groups == []
    assert r.fixed_buffers["bn.running_mean"].startswith("read by view")


class Pool(torch.nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.c1, self.c2 = torch.nn.Conv2d(2, 5, 3, padding=1), torch.nn.Conv2d(5, 4, 1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.c2(self.pool(self.c1(x))).mean(dim=(2, 3)))


@pytest.mark.parametrize("pool,kind", [
    (torch.nn.MaxPool2d(2), "scaled_perm"), (torch.nn.MaxPool2d(3, 1, 1), "scaled_perm"),
    (lambda y: F.max_pool2d(y, 2, return_indices=True)[0], "scaled_perm"),
    (torch.nn.AdaptiveMaxPool2d(3), "scaled_perm"), (torch.nn.AvgPool2d(2), "gl"),
    (torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False), "gl"),
    (torch.nn.AdaptiveAvgPool2d((2, 3)), "gl"), (torch.nn.ReflectionPad2d(1), "gl"),
    (torch.nn.Upsample(scale_factor=2), "gl"), (torch.nn.Upsample(scale_factor=2, mode="bilinear"), "gl"),
    (lambda y: F.max_pool1d(y.flatten(2), 2).unsqueeze(-1), "scaled_perm"),
    (lambda y: F.avg_pool1d(y.flatten(2), 2).unsqueeze(-1), "gl"),
], ids=["max", "max_padded", "max_indices", "adaptive_max", "avg", "avg_no_pad", "adaptive_avg",
        "reflect", "nearest", "bilinear", "max1d", "avg1d"])
def test_pooling_passes_channels(pool, kind):
    """Pooling acts on every channel's spatial slice alike: linear ones keep any map of the
    channels, max pooling positive scaled permutations; spatial axes stay fixed."""
    r = analyze(Pool(pool), x_of(B, 2, 6, 6))
    assert summary(r) == {
        (kind, 5, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)},
        ("gl", 4, 1): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}
    assert r.frozen == []


class GroupedConv(torch.nn.Module):
    def __init__(self, groups, mid=6, out=6):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, mid, 1)
        self.c2 = torch.nn.Conv2d(mid, out, 3, padding=1, groups=groups)
        self.fc = torch.nn.Linear(out, 3)

    def forward(self, x):
        return self.fc(self.c2(torch.relu(self.c1(x))).mean(dim=(2, 3)))


def test_depthwise_conv_is_one_permutation_class():
    r = analyze(GroupedConv(6), x_of(B, 2, 5, 5))
    # one filter per channel: input and output channels are one class, permutations only
    assert summary(r) == {("perm", 6, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 0),
                                           ("c2.bias", 0), ("fc.weight", 1)}}
    r = analyze(GroupedConv(6, out=12), x_of(B, 2, 5, 5))  # depth multiplier 2
    assert structure(r, "c2.weight", 0) == ("prod", [6, 2])
    assert summary(r) == {("perm", 6, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 0),
                                           ("c2.bias", 0), ("fc.weight", 1)},
                          ("gl", 12, 6): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}  # per channel


def test_grouped_conv_permutes_whole_groups():
    r = analyze(GroupedConv(3, mid=6, out=9), x_of(B, 2, 5, 5))  # 3 groups: 2 -> 3 channels each
    assert structure(r, "c1.weight", 0) == ("prod", [3, 2])
    assert structure(r, "c2.weight", 0) == ("prod", [3, 3])
    assert summary(r) == {
        ("perm", 3, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 0), ("c2.bias", 0),
                         ("fc.weight", 1)},
        ("scaled_perm", 2, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)},
        ("gl", 9, 3): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}  # one map per group


class CrossedGroups(torch.nn.Module):
    """Grouped convolutions whose groups cross (3 of 4 channels, then 4 of 3)."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, 12, 1)
        self.c2 = torch.nn.Conv2d(12, 12, 3, padding=1, groups=3)
        self.c3 = torch.nn.Conv2d(12, 8, 1, groups=4)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))
        return self.fc(h.mean(dim=(2, 3)))


def test_crossing_group_structures_fix_the_axis_and_its_parts():
    r = analyze(CrossedGroups(), x_of(B, 2, 5, 5))
    # c2's output is fixed, with the parts of both its structures (c2's groups, c3's groups);
    # c1's channels within a group and c3's outputs within a group still move
    assert r.group_of("c2.weight", 0) == [] and r.group_of("c3.weight", 1) == []
    assert structure(r, "c3.weight", 0) == ("prod", [4, 2])
    assert summary(r) == {("scaled_perm", 4, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)},
                          ("gl", 8, 4): {("c3.weight", 0), ("c3.bias", 0), ("fc.weight", 1)}}


class Aggregate(torch.nn.Module):
    """Three token vectors stacked and mixed by a ``Conv1d`` over the stack (CoaT's head): the
    features are the convolution's spatial axis, each position mapped alone when the kernel
    is 1 (``kernel=3``: neighbouring features mix)."""

    def __init__(self, kernel, bias):
        super().__init__()
        self.l1, self.l2, self.l3 = (torch.nn.Linear(6, 8) for _ in range(3))
        self.agg = torch.nn.Conv1d(3, 1, kernel, padding=kernel // 2, bias=bias)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.stack([torch.tanh(m(x)) for m in (self.l1, self.l2, self.l3)], 1)
        return self.fc(torch.tanh(self.agg(h).squeeze(1)))


@pytest.mark.parametrize("kernel,bias", [(1, True), (1, False), (3, True)])
def test_a_size_one_kernel_maps_each_position_alone(kernel, bias):
    """Kernel 1, stride 1, no padding: the spatial axis is a batch of positions, so the
    features keep one class through the convolution (signed permutations, the tanh's; perm
    with a bias, added at every position); kernel 3 fixes them. The class is recovered by
    weights."""
    x = x_of(B, 6)
    r = analyze(Aggregate(kernel, bias), x)
    slots = {(f"l{i}.{t}", 0) for i in (1, 2, 3) for t in ("weight", "bias")} | {("fc.weight", 1)}
    found = summary(r).get(("perm" if bias else "signed_perm", 8, 1))
    assert found == (slots if kernel == 1 else None)
    if kernel == 1:
        torch.manual_seed(0)
        m = Aggregate(kernel, bias)
        moved = symgraph.transform(m, symgraph.analyze(m, (x,)).random_transform(seed=2))
        back = symgraph.align(m, moved, (x,)).apply(moved)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in
                   zip(m.state_dict().values(), back.state_dict().values()))

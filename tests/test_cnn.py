"""Convolutional nets, Git Re-Basin's own setting: BatchNorm (running statistics are buffers
that move with the channels), max / average pooling, flatten into a linear head, residual
blocks, depthwise and grouped convolutions. Each net is analysed (the groups it must have),
certified in float64, recovered exactly from a permuted copy by weight matching (buffers
included) and merged with that copy back into itself; Hugging Face's RegNet and MobileNetV2
(tiny configs, random weights) are certified with their groups.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph

CERT = 1e-8
TOL = 1e-6


def randomize(model, seed=0):
    """Random weights and random BatchNorm running statistics and affine (defaults of ones and
    zeros would hide a wrong slot), eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.running_mean.normal_(generator=g)
                m.running_var.uniform_(0.5, 2, generator=g)
                m.num_batches_tracked.fill_(7 + seed)
    return model.eval()


def image(seed=1):
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


class VGG(nn.Module):
    """(conv-BN-ReLU-maxpool) ×2, then flatten + linear head."""

    def __init__(self, w=(8, 16)):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, w[0], 3, padding=1), nn.BatchNorm2d(w[0])
        self.c2, self.b2 = nn.Conv2d(w[0], w[1], 3, padding=1), nn.BatchNorm2d(w[1])
        self.fc = nn.Linear(w[1] * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        return self.fc(torch.flatten(x, 1))


class ResNet(nn.Module):
    """Stem (conv-BN-ReLU-avgpool), one basic block (conv-BN-ReLU-conv-BN + identity skip,
    ReLU), adaptive average pool, linear head."""

    def __init__(self, w=8, mid=12):
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)
        self.ca, self.ba = nn.Conv2d(w, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.cb, self.bb = nn.Conv2d(mid, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(w, 10)

    def forward(self, x):
        x = F.avg_pool2d(F.relu(self.b0(self.stem(x))), 2)
        x = F.relu(x + self.bb(self.cb(F.relu(self.ba(self.ca(x))))))
        return self.fc(self.pool(x).flatten(1))


class MobileNet(nn.Module):
    """Stem, then a depthwise-separable block: depthwise conv-BN-ReLU6, pointwise conv-BN-ReLU6."""

    def __init__(self, w=8, out=16):
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w)
        self.dw, self.b1 = nn.Conv2d(w, w, 3, padding=1, groups=w, bias=False), nn.BatchNorm2d(w)
        self.pw, self.b2 = nn.Conv2d(w, out, 1, bias=False), nn.BatchNorm2d(out)
        self.fc = nn.Linear(out, 10)

    def forward(self, x):
        x = F.relu6(self.b0(self.stem(x)))
        x = F.relu6(self.b1(self.dw(x)))
        x = F.relu6(self.b2(self.pw(x)))
        return self.fc(x.mean((2, 3)))


class ResNeXt(nn.Module):
    """conv-BN-ReLU, a grouped conv (3 groups of 4) -BN-ReLU, a grouped conv whose 6 groups
    refine those (of 2 channels), a depthwise conv with multiplier 2, max pool, linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 12, 1), nn.BatchNorm2d(12)
        self.c2, self.b2 = nn.Conv2d(12, 12, 3, padding=1, groups=3), nn.BatchNorm2d(12)
        self.c3 = nn.Conv2d(12, 18, 3, groups=6)
        self.c4 = nn.Conv2d(18, 36, 3, groups=18)
        self.fc = nn.Linear(36, 5)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = self.c4(torch.tanh(self.c3(x)))
        return self.fc(F.adaptive_max_pool2d(x, 1).flatten(1))


def kinds(report):
    return sorted((g.kind, g.size, g.blocks) for g in report.groups)


def slots(report, param, dim=0):
    """The group acting on ``param``'s ``dim`` (exactly one)."""
    (g,) = report.group_of(param, dim)
    return g


def assert_state_equal(a, b, tol=TOL):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].double(), sb[k].double(), atol=tol, rtol=0), k


def roundtrip(model, x, seed=5):
    """Analyse and certify ``model``; a random permuted copy must be recovered exactly by
    weight matching, and merged with ``model`` into ``model``, buffers included."""
    report = symgraph.analyze(model, (x,))
    assert report.certify(model, (x,)) < CERT
    moved = symgraph.transform(model, report.random_transform(seed=seed, orthogonal=True))
    for b in report.buffers:  # the running statistics moved with the channels
        assert not torch.equal(moved.get_buffer(b), model.get_buffer(b)), b
    with torch.no_grad():  # float32 sums in another order: the tolerance scales with the outputs
        out = model(x)
        assert torch.allclose(moved(x), out, atol=1e-6 * max(1.0, out.abs().max().item()), rtol=1e-5)
    al = symgraph.align(model, moved, (x,))
    state = al.state(moved)
    assert set(report.buffers) <= set(state)
    for b in report.buffers:
        assert torch.allclose(state[b], model.get_buffer(b), atol=TOL), b
    assert_state_equal(al.apply(moved), model)
    res = symgraph.merge([model, moved], (x,))
    assert_state_equal(res.model, model)
    return report


def test_vgg():
    m, x = randomize(VGG()), image()
    r = roundtrip(m, x)
    assert kinds(r) == [("perm", 8, 1), ("perm", 16, 1)]  # BatchNorm leaves permutations
    assert all("batch normalisation" in g.why for g in r.groups)
    g1, g2 = slots(r, "c1.weight"), slots(r, "c2.weight")
    assert set(g1.params) == {("c1.weight", 0), ("c1.bias", 0), ("b1.weight", 0), ("b1.bias", 0),
                              ("c2.weight", 1)}
    assert set(g1.buffers) == {("b1.running_mean", 0), ("b1.running_var", 0)}
    assert ("fc.weight", 1) in g2.params  # the flatten: channels × 4 × 4 into the head
    assert r.axis_structure(r.param_axes("fc.weight")[1]) == ("prod", [16, 4, 4])
    assert r.frozen == [] and r.buffers == ["b1.running_mean", "b1.running_var",
                                            "b2.running_mean", "b2.running_var"]
    assert set(r.fixed_buffers) == {"b1.num_batches_tracked", "b2.num_batches_tracked"}


def test_resnet_block():
    m, x = randomize(ResNet()), image()
    r = roundtrip(m, x)
    assert kinds(r) == [("perm", 8, 1), ("perm", 12, 1)]
    skip = slots(r, "stem.weight")  # the skip: stem, second conv of the block, head
    assert {("cb.weight", 0), ("bb.weight", 0), ("ca.weight", 1), ("fc.weight", 1)} <= set(skip.params)
    assert set(skip.buffers) == {(f"{b}.running_{s}", 0) for b in ("b0", "bb") for s in ("mean", "var")}
    hidden = slots(r, "ca.weight")
    assert set(hidden.params) == {("ca.weight", 0), ("ba.weight", 0), ("ba.bias", 0), ("cb.weight", 1)}
    assert r.frozen == []


def test_mobilenet_block():
    m, x = randomize(MobileNet()), image()
    r = roundtrip(m, x)
    assert kinds(r) == [("perm", 8, 1), ("perm", 16, 1)]
    dw = slots(r, "dw.weight")  # depthwise: its input and output channels are one class
    assert dw is slots(r, "stem.weight") and ("pw.weight", 1) in dw.params
    assert {b for b, _ in dw.buffers} == {f"{b}.running_{s}" for b in ("b0", "b1") for s in ("mean", "var")}
    assert r.frozen == []


def test_grouped_convolutions():
    m, x = randomize(ResNeXt()), image()
    r = roundtrip(m, x)
    # c1's 12 channels are (3 groups × 4); c2's output (3 × 2 × 2) is refined by c3's 6 groups
    # of 2; c3's 18 outputs (6 × 3) are c4's depthwise channels, each with 2 outputs
    assert r.axis_structure(r.param_axes("c1.weight")[0]) == ("prod", [3, 4])
    assert r.axis_structure(r.param_axes("c4.weight")[0])[0] == "prod"
    # a grouped conv's outputs inside a group take a map per group (c3's 3 outputs per group:
    # one per each of its 6 groups; c4's multiplier 2: one per channel); its inputs inside a
    # group one map for every group (the weight's input axis does not say which group)
    assert kinds(r) == [("perm", 2, 1), ("perm", 3, 1), ("perm", 4, 1), ("perm", 6, 3),
                        ("perm", 18, 6), ("scaled_perm", 36, 18)]
    # nested along a chain: c2's groups (3), c3's (6 = 3 × 2), c4's channels (18 = 6 × 3)
    assert {g.blocks: len(g.outer) for g in r.groups if g.outer} == {3: 1, 6: 2, 18: 3}
    assert "groups of a grouped convolution" in r.groups[0].why  # the report says what it did
    assert r.frozen == []


def test_merged_running_stats_are_the_weighted_average_of_the_aligned_ones():
    a, b, x = randomize(VGG(), 0), randomize(VGG(), 1), image()
    res = symgraph.merge([a, b], (x,), weights=[1, 3])
    state = res.alignments[1].state(b)
    for name in ("b1.running_mean", "b1.running_var", "b2.running_mean", "b2.running_var"):
        want = 0.25 * a.get_buffer(name) + 0.75 * state[name]
        assert torch.allclose(res.model.get_buffer(name), want, atol=1e-6), name
        assert not torch.allclose(state[name], b.get_buffer(name))  # B's were permuted
    # buffers no class touches stay the anchor's
    assert res.model.get_buffer("b1.num_batches_tracked") == a.get_buffer("b1.num_batches_tracked")
    # without alignment: the plain weighted average
    plain = symgraph.merge([a, b], (x,), weights=[1, 3], align=None)
    want = 0.25 * a.get_buffer("b2.running_var") + 0.75 * b.get_buffer("b2.running_var")
    assert torch.allclose(plain.model.get_buffer("b2.running_var"), want, atol=1e-6)


def test_inputs_untouched_and_transform_copies_buffers():
    m, x = randomize(VGG()), image()
    before = copy.deepcopy(m.state_dict())
    r = symgraph.analyze(m, (x,))
    t = r.random_transform(seed=2)
    moved = symgraph.transform(m, t)
    idx = t.elements[slots(r, "c2.weight").id].index
    assert torch.equal(moved.get_buffer("b2.running_var"), m.get_buffer("b2.running_var")[idx])
    for k, v in before.items():
        assert torch.equal(m.state_dict()[k], v), k


# --- Hugging Face convolutional models ----------------------------------------------------
transformers = pytest.importorskip("transformers")


def _pixels():
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}


def test_regnet():
    cfg = transformers.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2],
                                    groups_width=4, layer_type="y", num_labels=5)
    m, x = randomize(transformers.RegNetForImageClassification(cfg)), _pixels()
    r = symgraph.analyze(m, x)
    assert r.certify(m, x) < CERT
    assert r.frozen == [] and len(r.buffers) == 2 * sum(
        isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    # streams: embedder (8), stage 0 (8), stage 1 (16); per Y block a grouped conv of width-4
    # groups: the groups (2 in stage 0, 4 in stage 1), one map inside them before it and one per
    # group after it; the squeeze-excitation bottlenecks (ReLU: scaled permutations)
    assert kinds(r) == sorted([("perm", 8, 1), ("perm", 8, 1), ("perm", 16, 1), ("perm", 2, 1)]
                              + [("perm", 4, 1)] * 5 + [("perm", 8, 2)] + [("perm", 16, 4)] * 2
                              + [("scaled_perm", 2, 1)] * 2 + [("scaled_perm", 4, 1)])
    b = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, b, x)
    assert_state_equal(al.apply(b), m)


def test_mobilenet_v2():
    cfg = transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25, min_depth=4,
                                         num_labels=5)
    m, x = randomize(transformers.MobileNetV2ForImageClassification(cfg)), _pixels()
    r = symgraph.analyze(m, x)
    assert r.certify(m, x) < CERT
    assert r.frozen == [] and r.fixed_buffers and all(
        n.endswith("num_batches_tracked") for n in r.fixed_buffers)
    # every inverted residual block's expanded channels (expand 1x1, depthwise 3x3, project
    # 1x1 read them) are one permutation class, as are the residual streams of each stage
    expanded = [mod for name, mod in m.named_modules() if name.endswith("conv_3x3.convolution")]
    for conv in expanded:
        name = next(n for n, mod in m.named_modules() if mod is conv)
        g = slots(r, f"{name}.weight")
        assert g.kind == "perm" and g.size == conv.out_channels
    assert len(r.groups) == 25 and all(g.kind == "perm" for g in r.groups)

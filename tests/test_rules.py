"""Per-op rules, checked through tiny modules: the exact groups each rule produces (kinds,
sizes, slots, structure), and a certificate for every module.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import symgraph
from symgraph.passes.views import refine

TOL = 1e-6
B, S = 2, 5


def analyze(mod, *xs):
    """Analyse ``mod`` on ``xs`` and check the certificate; return the report."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.5)
    report = symgraph.analyze(mod, inputs=tuple(xs))
    assert report.certify(mod, inputs=tuple(xs)) <= TOL
    return report


def x_of(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def summary(report):
    """``{(kind, size, blocks): set of slots}``, asserting no two groups collide."""
    out = {}
    for g in report.groups:
        key = (g.kind, g.size, g.blocks)
        assert key not in out, f"two groups {key}"
        out[key] = set(g.params)
    return out


def structure(report, param, dim):
    """``(kind, part sizes)`` of the class of ``param``'s axis ``dim`` (None: a leaf)."""
    s = report.axis_structure(report.param_axes(param)[dim])
    return None if s is None else (s[0], s[1])


# --- view / reshape -----------------------------------------------------------------------
def test_refine_exact():
    assert refine([2, 16], [8, 4]) == ([2, 4, 4], [[0], [1, 2]], [[0, 1], [2]])
    assert refine([4, 8], [8, 4]) == ([4, 2, 4], [[0], [1, 2]], [[0, 1], [2]])
    assert refine([12], [3, 4]) == ([3, 4], [[0, 1]], [[0], [1]])
    assert refine([3, 4], [3, 4]) == ([3, 4], [[0], [1]], [[0], [1]])
    assert refine([6, 4], [4, 6]) is None  # crossing factorisations
    assert refine([2, 3], [3, 2]) is None


class HeadView(torch.nn.Module):
    """``[B, S, H*d] -> [B, S, H, d]``, a per-head softmax, and back."""

    def __init__(self, c=5, h=3, d=4):
        super().__init__()
        self.h, self.d = h, d
        self.inp = torch.nn.Linear(c, h * d)
        self.out = torch.nn.Linear(h * d, 2)

    def forward(self, x):
        y = self.inp(x).view(B, S, self.h, self.d)
        y = torch.softmax(y, dim=-1)  # mixes within a head only
        return self.out(y.reshape(B, S, self.h * self.d))


def test_view_makes_product_class():
    r = analyze(HeadView(), x_of(B, S, 5))
    assert structure(r, "inp.weight", 0) == ("prod", [3, 4])
    assert structure(r, "out.weight", 1) == ("prod", [3, 4])
    slots = {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}
    # heads and head_dim both permutable; the head_dim permutation independently per head
    s = summary(r)
    assert s == {("perm", 3, 1): slots, ("perm", 12, 3): slots}
    inner = next(g for g in r.groups if g.blocks == 3)
    outer = next(g for g in r.groups if g.blocks == 1)
    assert inner.outer == [outer.id] and inner.dim == 4


class HeadMix(torch.nn.Module):
    """Per-head values mixed *across* heads along the head axis (cumsum / flip / roll)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.inp = torch.nn.Linear(5, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        y = self.inp(x).view(B, S, 2, 4)
        return self.out(self.op(y).reshape(B, S, 8))


@pytest.mark.parametrize("op,kind", [(lambda y: y.cumsum(2), "gl"), (lambda y: y.flip(2), "gl"),
                                     (lambda y: y.roll(1, 2), "gl"), (lambda y: y.cumprod(2), "perm")],
                         ids=["cumsum", "flip", "roll", "cumprod"])
def test_order_dependent_op_over_heads_has_no_per_head_element(op, kind):
    # the head axis is fixed, and the inner element may not vary per head: entries of
    # different heads are mixed (cumsum) or moved (flip, roll); a running product is nonlinear
    r = analyze(HeadMix(op), x_of(B, S, 5))
    assert [(g.kind, g.size, g.dim, g.blocks) for g in r.groups] == [(kind, 4, 4, 1)]


class SwappedMerge(torch.nn.Module):
    """Attention whose heads are merged as ``(head_dim, heads)`` instead of ``(heads, head_dim)``."""

    def __init__(self, c=5, h=3, d=2):
        super().__init__()
        self.h, self.d = h, d
        self.q, self.k, self.v = (torch.nn.Linear(c, h * d) for _ in range(3))
        self.o = torch.nn.Linear(h * d, 4)

    def forward(self, x):
        q, k, v = (p(x).view(B, S, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # [B, H, S, d]
        return self.o(y.permute(0, 2, 3, 1).reshape(B, S, self.d * self.h))


def test_head_merge_order_does_not_matter():
    r = analyze(SwappedMerge(), x_of(B, S, 5))
    assert structure(r, "o.weight", 1) == ("prod", [2, 3])  # (d, H) here, (H, d) in v
    assert structure(r, "v.weight", 0) == ("prod", [3, 2])
    kinds = sorted((g.kind, g.size, g.blocks) for g in r.groups)
    assert kinds == [("gl", 6, 3), ("gl", 6, 3), ("perm", 3, 1)]


# --- slice / cat --------------------------------------------------------------------------
class SliceCat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 7)
        self.out = torch.nn.Linear(7, 2)

    def forward(self, x):
        y = self.inp(x)
        return self.out(torch.cat([torch.relu(y[..., :3]), torch.tanh(y[..., 3:])], dim=-1))


def test_slice_cat_make_sum_structure():
    r = analyze(SliceCat(), x_of(B, 4))
    assert structure(r, "inp.weight", 0) == ("sum", [3, 4])
    assert structure(r, "out.weight", 1) == ("sum", [3, 4])
    slots = {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}
    assert summary(r) == {("scaled_perm", 3, 1): slots, ("signed_perm", 4, 1): slots}


class SplitCat(torch.nn.Module):
    """``split`` into uneven chunks, and a concatenation in another order."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        a, b = torch.split(self.inp(x), [2, 4], dim=-1)
        return self.out(torch.cat([F.gelu(b), a], dim=-1))


def test_split_and_reordered_cat():
    r = analyze(SplitCat(), x_of(B, 4))
    assert structure(r, "inp.weight", 0) == ("sum", [2, 4])
    assert structure(r, "out.weight", 1) == ("sum", [4, 2])
    slots = {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}
    assert summary(r) == {("gl", 2, 1): slots, ("perm", 4, 1): slots}


class Strided(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.out = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.inp(x)[..., ::2])


def test_strided_slice_fixes_the_axis():
    assert analyze(Strided(), x_of(B, 4)).groups == []


# --- elementwise --------------------------------------------------------------------------
@pytest.mark.parametrize("act,kind", [
    (torch.nn.ReLU(), "scaled_perm"), (torch.nn.LeakyReLU(0.1), "scaled_perm"),
    (torch.nn.Tanh(), "signed_perm"), (torch.sin, "signed_perm"),
    (torch.nn.GELU(), "perm"), (torch.nn.SiLU(), "perm"), (torch.nn.Sigmoid(), "perm"),
    (torch.nn.Identity(), "gl"), (lambda y: 3.0 * y, "gl"), (lambda y: y / 2, "gl"),
    (lambda y: y + 1.0, "perm"), (torch.nn.LayerNorm(6), "orthogonal_mean"),
    (torch.nn.RMSNorm(6), "orthogonal"),
], ids=["relu", "leaky_relu", "tanh", "sin", "gelu", "silu", "sigmoid", "identity", "scale",
        "div", "shift", "layernorm", "rmsnorm"])
def test_elementwise_kind(act, kind):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3), act

        def forward(self, x):
            return self.b(self.act(self.a(x)))

    m = M()
    r = analyze(m, x_of(B, 4))
    slots = {("a.weight", 0), ("a.bias", 0), ("b.weight", 1)}
    # a norm's gain (and shift) fold into b, which reads it: the normalised axis then takes
    # rotations (fixing 𝟙 for LayerNorm); the certificate checks it
    assert summary(r) == {(kind, 6, 1): slots}
    variance = dict(zip(r.groups[0].params, r.groups[0].variance))
    assert variance[("a.weight", 0)] == "co" and variance[("b.weight", 1)] == "contra"
    if isinstance(act, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        assert [f.gain for f in r.folds] == ["act.weight"]
        with torch.no_grad():
            m.act.weight.uniform_(0.5, 1.5)
        assert r.certify(m) < 1e-9
        unfolded = symgraph.analyze(m, (x_of(B, 4),), fold_norms=False)  # without folding: perms
        norm = {("act.weight", 0)} | ({("act.bias", 0)} if isinstance(act, torch.nn.LayerNorm) else set())
        assert summary(unfolded) == {("perm", 6, 1): slots | norm}


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.g, self.u, self.d = torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.d(torch.relu(self.g(x)) * self.u(x))


def test_gating_product_is_perm():
    r = analyze(Gate(), x_of(B, 4))
    assert summary(r) == {("perm", 6, 1): {("g.weight", 0), ("u.weight", 0), ("u.bias", 0), ("d.weight", 1)}}


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(3, 5)
        self.up, self.down = torch.nn.Linear(5, 7), torch.nn.Linear(7, 5)
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


def test_residual_add_unifies_the_stream():
    r = analyze(Residual(), x_of(B, 3))
    assert summary(r) == {
        ("gl", 5, 1): {("emb.weight", 0), ("emb.bias", 0), ("up.weight", 1), ("down.weight", 0),
                       ("down.bias", 0), ("head.weight", 1)},
        ("scaled_perm", 7, 1): {("up.weight", 0), ("up.bias", 0), ("down.weight", 1)}}


# --- contractions -------------------------------------------------------------------------
class Scores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6)

    def forward(self, x):
        return self.q(x) @ self.k(x).transpose(-1, -2)


def test_qk_contraction_is_dual():
    r = analyze(Scores(), x_of(B, S, 4))
    (g,) = r.groups
    assert (g.kind, g.size) == ("gl", 6)
    assert dict(zip(g.params, g.variance)) == {
        ("q.weight", 0): "co", ("q.bias", 0): "co", ("k.weight", 0): "contra", ("k.bias", 0): "contra"}


def test_dual_cycle_narrows_to_orthogonal():
    class SelfScores(torch.nn.Module):  # q·qᵀ: the contraction pairs the class with its own dual
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(4, 6)

        def forward(self, x):
            q = self.q(x)
            return q @ q.transpose(-1, -2)

    r = analyze(SelfScores(), x_of(B, S, 4))
    assert [(g.kind, g.size) for g in r.groups] == [("orthogonal", 6)]


class Broadcast(torch.nn.Module):
    """An axis created by ``expand`` over a size-1 axis, flattened into a linear's input."""

    def __init__(self, n=3, m=4):
        super().__init__()
        self.n, self.m = n, m
        self.a = torch.nn.Linear(5, n)
        self.b = torch.nn.Linear(n * m, 2)

    def forward(self, x):
        h = self.a(x).unsqueeze(-1).expand(B, S, self.n, self.m)
        return self.b(h.reshape(B, S, self.n * self.m))


def test_expand_over_size_one_axis_is_perm():
    r = analyze(Broadcast(), x_of(B, S, 5))
    assert structure(r, "b.weight", 1) == ("prod", [3, 4])
    assert summary(r) == {("gl", 3, 1): {("a.weight", 0), ("a.bias", 0), ("b.weight", 1)},
                          ("perm", 4, 1): {("b.weight", 1)}}


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
                          ("gl", 2, 1): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}


def test_grouped_conv_permutes_whole_groups():
    r = analyze(GroupedConv(3, mid=6, out=9), x_of(B, 2, 5, 5))  # 3 groups: 2 -> 3 channels each
    assert structure(r, "c1.weight", 0) == ("prod", [3, 2])
    assert structure(r, "c2.weight", 0) == ("prod", [3, 3])
    assert summary(r) == {
        ("perm", 3, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 0), ("c2.bias", 0),
                         ("fc.weight", 1)},
        ("scaled_perm", 2, 1): {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)},
        ("gl", 3, 1): {("c2.weight", 0), ("c2.bias", 0), ("fc.weight", 1)}}


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
                          ("gl", 2, 1): {("c3.weight", 0), ("c3.bias", 0), ("fc.weight", 1)}}


# --- attention ----------------------------------------------------------------------------
class GQA(torch.nn.Module):
    """Grouped-query attention: ``expand`` + ``reshape`` (HF's repeat_kv) or SDPA's enable_gqa."""

    def __init__(self, native, h=4, kv=2, d=3):
        super().__init__()
        self.native, self.h, self.kv, self.d = native, h, kv, d
        self.q = torch.nn.Linear(5, h * d)
        self.k, self.v = torch.nn.Linear(5, kv * d), torch.nn.Linear(5, kv * d)
        self.o = torch.nn.Linear(h * d, 5)

    def forward(self, x):
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, S, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(B, S, self.kv, self.d).transpose(1, 2)
        if self.native:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            r = self.h // self.kv
            k, v = (t[:, :, None].expand(B, self.kv, r, S, self.d).reshape(B, self.h, S, self.d)
                    for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, self.h * self.d))


@pytest.mark.parametrize("native", [False, True], ids=["repeat_kv", "enable_gqa"])
def test_gqa(native):
    r = analyze(GQA(native), x_of(B, S, 5))
    assert sorted((g.kind, g.size, g.dim, g.blocks) for g in r.groups) == [
        ("gl", 6, 3, 2), ("gl", 6, 3, 2), ("perm", 2, 2, 1), ("perm", 4, 2, 2)]
    kv = next(g for g in r.groups if g.size == 2)
    qk, vo = sorted((g for g in r.groups if g.kind == "gl"), key=lambda g: ("v.weight", 0) in g.params)
    assert set(qk.params) == {("q.weight", 0), ("q.bias", 0), ("k.weight", 0), ("k.bias", 0)}
    assert set(vo.params) == {("v.weight", 0), ("v.bias", 0), ("o.weight", 1)}
    assert qk.outer == vo.outer == [kv.id]


class EagerAttention(torch.nn.Module):
    def __init__(self, h=2, d=3):
        super().__init__()
        self.h, self.d = h, d
        self.q, self.k, self.v = (torch.nn.Linear(5, h * d) for _ in range(3))
        self.o = torch.nn.Linear(h * d, 5)

    def forward(self, x):
        q, k, v = (p(x).view(B, S, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d), dim=-1)
        return self.o((a @ v).transpose(1, 2).reshape(B, S, self.h * self.d))


def test_eager_attention_matches_sdpa_structure():
    r = analyze(EagerAttention(), x_of(B, S, 5))
    assert sorted((g.kind, g.size, g.dim, g.blocks) for g in r.groups) == [
        ("gl", 6, 3, 2), ("gl", 6, 3, 2), ("perm", 2, 2, 1)]


# --- rotary -------------------------------------------------------------------------------
def _freqs(d, dtype=torch.float32):
    pos = torch.arange(S, dtype=dtype)[:, None]
    return pos * torch.exp(-torch.arange(d // 2, dtype=dtype))  # [S, d/2]


class Rope(torch.nn.Module):
    """RoPE on Q and K by hand: rotate_half or interleaved pairs; ``broken`` uses constants that
    are not equal on the two coordinates of a pair (not a rotation: must not be claimed)."""

    def __init__(self, style, d=6, broken=False):
        super().__init__()
        self.style, self.d, self.broken = style, d, broken
        self.q, self.k = torch.nn.Linear(4, d), torch.nn.Linear(4, d)
        self.register_buffer("noise", torch.rand(d) + 0.5)

    def rotate(self, x):
        if self.style == "half":
            h = self.d // 2
            return torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, x):
        f = _freqs(self.d)
        emb = torch.cat([f, f], -1) if self.style == "half" else f.repeat_interleave(2, -1)
        cos, sin = emb.cos(), emb.sin()
        if self.broken:
            cos = cos * self.noise
        q, k = self.q(x), self.k(x)
        q = q * cos + self.rotate(q) * sin
        k = k * cos + self.rotate(k) * sin
        return q @ k.transpose(-1, -2)


@pytest.mark.parametrize("style,pairs", [("half", ((0, 3), (1, 4), (2, 5))),
                                         ("interleaved", ((0, 1), (2, 3), (4, 5)))])
def test_rope_pairs(style, pairs):
    r = analyze(Rope(style), x_of(B, S, 4))
    (g,) = r.groups
    assert (g.kind, g.size, g.pairs) == ("rope", 6, pairs)
    assert dict(zip(g.params, g.variance)) == {
        ("q.weight", 0): "co", ("q.bias", 0): "co", ("k.weight", 0): "contra", ("k.bias", 0): "contra"}
    assert g.dof == 3


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_with_unpaired_constants_is_not_claimed(style):
    r = analyze(Rope(style, broken=True), x_of(B, S, 4))
    assert [g.kind for g in r.groups] == []


class RopeThenSplit(torch.nn.Module):
    """A rotary axis cut afterwards: the pairs cross the cut, so nothing survives."""

    def __init__(self, d=6, cut=3):
        super().__init__()
        self.d, self.cut = d, cut
        self.q, self.k = torch.nn.Linear(4, d), torch.nn.Linear(4, d)

    def forward(self, x):
        f = _freqs(self.d)
        emb = torch.cat([f, f], -1)
        h = self.d // 2
        rot = lambda t: torch.cat([-t[..., h:], t[..., :h]], dim=-1)  # noqa: E731
        q, k = self.q(x), self.k(x)
        q = q * emb.cos() + rot(q) * emb.sin()
        k = k * emb.cos() + rot(k) * emb.sin()
        q = torch.cat([2 * q[..., :self.cut], q[..., self.cut:]], dim=-1)
        return q @ k.transpose(-1, -2)


def test_rope_class_cut_later():
    r = analyze(RopeThenSplit(), x_of(B, S, 4))
    assert r.groups == []
    r.random_transform(0)  # no rope group without its pairs


def test_partial_rope_by_hand():
    class Partial(Rope):
        def forward(self, x):
            rd = 4
            f = _freqs(rd)
            emb = torch.cat([f, f], -1)
            rot = lambda t: torch.cat([-t[..., 2:], t[..., :2]], dim=-1)  # noqa: E731
            out = []
            for t in (self.q(x), self.k(x)):
                a, b = t[..., :rd], t[..., rd:]
                out.append(torch.cat([a * emb.cos() + rot(a) * emb.sin(), b], dim=-1))
            return out[0] @ out[1].transpose(-1, -2)

    r = analyze(Partial("half"), x_of(B, S, 4))
    assert sorted((g.kind, g.size, g.pairs) for g in r.groups) == [
        ("gl", 2, None), ("rope", 4, ((0, 2), (1, 3)))]


# --- rounding, casts and copies -----------------------------------------------------------
@pytest.mark.parametrize("f", [lambda h: torch.div(h, 0.3, rounding_mode="floor"),
                               lambda h: torch.div(h, 0.3, rounding_mode="trunc"),
                               lambda h: (3 * h).to(torch.int64).to(h.dtype),
                               lambda h: h.bool().to(h.dtype) * h],
                         ids=["floor_div", "trunc_div", "int_cast", "bool_cast"])
def test_rounding_is_nonlinear(f):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.b(f(self.a(x)))

    r = analyze(M(), x_of(B, 4))
    assert [(g.kind, g.size) for g in r.groups] == [("perm", 6)]


def test_functional_copy_takes_the_source():
    """``dst.copy_(src)`` functionalised to ``copy(dst, src)`` has src's values, not dst's."""
    from symgraph.passes import analyze_graph
    from symgraph.report import SymmetryReport

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            h.copy_(self.b(x))
            return self.c(h)

    m = M()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = x_of(B, 4)
    ep = torch.export.export(m, (x,), strict=False).run_decompositions({})
    assert "aten.copy.default" in {str(n.target) for n in ep.graph.nodes}
    r = SymmetryReport(analyze_graph(ep), "M", ((x,), {}))
    assert r.certify(m, inputs=(x,)) <= TOL
    by_slot = {p: g for g in r.groups for p in g.params}
    # b's rows flow into c; a's rows are overwritten (a free class of their own)
    assert by_slot[("b.weight", 0)] is by_slot[("c.weight", 1)]
    assert by_slot[("a.weight", 0)] is not by_slot[("c.weight", 1)]


# --- token-axis ops leave channels alone ------------------------------------------------------
class PoolByIndex(torch.nn.Module):
    """Sequence classification's pooling: the hidden state at each row's last position."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)

    def forward(self, x, last):
        h = torch.relu(self.inp(x))
        return self.out(h[torch.arange(x.shape[0]), last])


class PadTokens(torch.nn.Module):
    """Padding along the sequence (and a nonzero pad along another axis)."""

    def __init__(self, value=0.0):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)
        self.value = value

    def forward(self, x):
        h = F.pad(torch.relu(self.inp(x)).transpose(1, 2), (1, 2), value=self.value)
        return self.out(h.transpose(1, 2))


def test_pooling_by_index_keeps_channel_groups():
    x = x_of(B, 5, 4)
    last = torch.arange(B) % 5
    m = PoolByIndex()
    r = analyze(m, x, last)
    assert summary(r) == {("scaled_perm", 6, 1): {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}}
    assert r.frozen == []


@pytest.mark.parametrize("value,kind", [(0.0, "scaled_perm"), (1.0, "perm")])
def test_constant_pad_along_tokens_keeps_channel_groups(value, kind):
    r = analyze(PadTokens(value), x_of(B, 5, 4))
    assert summary(r) == {(kind, 6, 1): {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}}
    assert r.frozen == []

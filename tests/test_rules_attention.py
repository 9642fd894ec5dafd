"""Per-op rules, checked through tiny modules: contractions (QK scores, dual cycles, expand),
grouped-query and eager attention, rotary embeddings.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import symgraph
from rules_helpers import B, S, analyze, structure, summary, x_of


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


class MaskedEager(torch.nn.Module):
    """Eager grouped-query attention as Hugging Face writes it: scores plus an additive causal
    mask filled with ``finfo.min`` (``where``) or ``-inf`` (``masked_fill``), then a softmax."""

    def __init__(self, fill, h=4, kv=2, d=4, D=8):
        super().__init__()
        self.fill, self.h, self.kv, self.d = fill, h, kv, d
        self.q, self.o = torch.nn.Linear(D, h * d), torch.nn.Linear(h * d, D)
        self.k, self.v = torch.nn.Linear(D, kv * d), torch.nn.Linear(D, kv * d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = (p(x).view(b, s, self.kv, self.d).transpose(1, 2)[:, :, None]
                .expand(b, self.kv, self.h // self.kv, s, self.d).reshape(b, self.h, s, self.d) for p in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) * self.d ** -0.5
        allowed = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        if self.fill == "where":
            scores = scores + torch.where(allowed, 0.0, torch.finfo(x.dtype).min)
        else:
            scores = scores.masked_fill(~allowed, float("-inf"))
        a = torch.softmax(scores, dim=-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("fill", ["where", "masked_fill"])
def test_masked_scores_are_not_observed_and_heads_match_by_activations(fill):
    """The masked scores hold the fill (about -3.4e38, the same in every head) between the mask
    and the softmax: no observation point there (it would swamp the heads' correlations), the
    scores before the mask are one; a transformed copy is recovered exactly by activations."""
    aten = torch.ops.aten
    m, x = MaskedEager(fill), x_of(B, 7, 8)
    r = analyze(m, x)
    heads = next(g for g in r.groups if g.kind == "perm" and g.size == 4)  # query heads in a group
    targets = {t.overloadpacket for _, _, t in (r.nodes()[pos] for pos, _, _ in r.observation_points(heads.id))}
    assert aten.matmul in targets and not targets & {aten.add, aten.masked_fill}, targets
    B2 = symgraph.transform(m, r.random_transform(seed=0))
    data = [(x_of(4, 9, 8) + i,) for i in range(3)]
    al = symgraph.align(m, B2, x, data=data, report_a=r, full_groups=True)
    for p, q in zip(m.parameters(), al.apply(B2).parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)


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

"""Per-op rules, checked through tiny modules: views and reshapes, slices and cats, and ops
along the token axis (index pooling, padding), which leave channels alone.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import symgraph

from symgraph.passes.rules.views import refine

from rules_helpers import B, S, analyze, structure, summary, x_of


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


class GatedHeads(torch.nn.Module):
    """A per-head output gate (Beam): ``g(x).view_as(y)`` (or ``reshape_as``) reshapes the flat
    gate ``[B, S, H*d]`` to the attention output's ``[B, S, H, d]``; ``y`` gives only the shape."""

    def __init__(self, as_op, c=5, h=3, d=4):
        super().__init__()
        self.as_op, self.h, self.d = as_op, h, d
        self.q, self.k, self.v, self.g = (torch.nn.Linear(c, h * d) for _ in range(4))
        self.gate_bias = torch.nn.Parameter(torch.zeros(h))
        self.o = torch.nn.Linear(h * d, 2)

    def forward(self, x):
        q, k, v = (p(x).view(B, S, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # [B, S, H, d]
        gate = getattr(self.g(x), self.as_op)(y) + self.gate_bias[None, None, :, None]
        return self.o((y * torch.sigmoid(gate)).reshape(B, S, self.h * self.d))


@pytest.mark.parametrize("as_op", ["view_as", "reshape_as"])
def test_view_as_reshapes_to_the_other_tensors_shape(as_op):
    # view_as was read as elementwise (output axes = input axes) and unified the gate's
    # [H*d] axis with the head axis [H]: "rule bug: unify axes of sizes 4 and 64" on Beam;
    # reshape_as had no rule and was decomposed by a re-trace, now it has view's
    m, x = GatedHeads(as_op), x_of(B, S, 5)
    r = analyze(m, x)
    assert r.frozen == []
    assert structure(r, "g.weight", 0) == ("prod", [3, 4]) == structure(r, "o.weight", 1)
    (heads,) = [g for g in r.groups if g.blocks == 1]
    assert (heads.kind, heads.dim) == ("perm", 3)
    assert {("g.weight", 0), ("gate_bias", 0), ("o.weight", 1)} <= set(heads.params)
    (gated,) = [g for g in r.groups if ("g.weight", 0) in g.params and g.blocks == 3]
    assert (gated.kind, gated.dim, gated.outer) == ("perm", 4, [heads.id])
    assert {("v.weight", 0), ("o.weight", 1)} <= set(gated.params)
    b = symgraph.transform(m, r.random_transform(seed=0))
    moved = [n for n, p in b.named_parameters() if not torch.equal(p, m.get_parameter(n))]
    assert {"g.weight", "gate_bias", "o.weight"} <= set(moved)
    al = symgraph.align(m, b, (x,), report_a=r, full_groups=True)
    back = al.apply(b)
    assert max(float((p - back.get_parameter(n)).abs().max()) for n, p in m.named_parameters()) < 1e-5


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
    def __init__(self, n=6):
        super().__init__()
        self.inp = torch.nn.Linear(4, n)
        self.out = torch.nn.Linear((n + 1) // 2, 2)

    def forward(self, x):
        return self.out(self.inp(x)[..., ::2])


def test_strided_slice_reads_the_axis_as_units_of_step_entries():
    """``x[..., ::2]`` of 6 entries picks entry 0 of each pair ``(2i, 2i+1)``: the axis is the
    product ``3 × 2`` with the pair position fixed; the 3 pairs move together (an 8-entry
    axis is not cut that way by ``[..., ::2]`` of 7 entries: fixed)."""
    r = analyze(Strided(), x_of(B, 4))
    assert summary(r) == {("gl", 3, 1): {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}}
    assert structure(r, "inp.weight", 0) == ("prod", [3, 2])
    assert analyze(Strided(7), x_of(B, 4)).groups == []


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


class GatherTokens(torch.nn.Module):
    """Hidden states gathered along the tokens by data (``torch.gather``, as RoBERTa gathers its
    token types by position ids), then read out."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x, pos):
        h = torch.relu(self.inp(x))
        picked = torch.gather(h, 1, pos[:, :, None].expand(-1, -1, h.shape[-1]))
        return self.out(picked)


def test_gather_along_tokens_keeps_channel_groups():
    """gather picks entries of one axis by values (fixed there); every other axis is one
    coordinate of input, index and output: the hidden units stay a class, nothing frozen
    (a permutation class: the index's hidden axis is an expanded constant, which a permutation
    leaves unchanged and the rule ties to the output's)."""
    x = x_of(B, 5, 4)
    pos = torch.tensor([[4, 0, 0], [1, 2, 3]])[:B]
    r = analyze(GatherTokens(), x, pos)
    assert summary(r) == {("perm", 6, 1): {("inp.weight", 0), ("inp.bias", 0), ("out.weight", 1)}}
    assert r.frozen == []

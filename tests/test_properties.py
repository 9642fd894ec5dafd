"""Property-based soundness: every group symgraph reports on a random network certifies.

Random networks are drawn from a small vocabulary of ops (linear, residual add, layer norm,
relu/gelu/tanh, gating product, multi-head attention through ``F.scaled_dot_product_attention``,
slice/cat on the channel axis, and an op without a rule). Soundness means the random group
element of *every* reported group, applied together, leaves the outputs unchanged in float64.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symgraph
from symgraph.groups import PERMUTATION_FAMILY
from symgraph.passes import has_rule

aten = torch.ops.aten
B, S = 2, 4

# The op without a rule: sorting the channels (values only) depends on their order and on
# their values, so no rule could claim more than identity; symgraph has none.
NORULE_OP = aten.sort.default
assert not has_rule(NORULE_OP)


# --- the vocabulary -----------------------------------------------------------------------
class Act(torch.nn.Module):
    FNS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return self.FNS[self.kind](x)


class Residual(torch.nn.Module):
    """``x + f(x)`` for a width-preserving block ``f``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Gate(torch.nn.Module):
    """GLU-style gate ``act(W_g x) * (W_u x)`` followed by a down projection."""

    def __init__(self, c, hidden, act, bias):
        super().__init__()
        self.gate = torch.nn.Linear(c, hidden, bias=bias)
        self.up = torch.nn.Linear(c, hidden, bias=bias)
        self.down = torch.nn.Linear(hidden, c, bias=bias)
        self.act = Act(act)

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Attention(torch.nn.Module):
    """Multi-head self-attention: head reshape, SDPA, merge heads, output projection."""

    def __init__(self, c, heads, bias, causal):
        super().__init__()
        self.h, self.d, self.causal = heads, c // heads, causal
        self.q = torch.nn.Linear(c, c, bias=bias)
        self.k = torch.nn.Linear(c, c, bias=bias)
        self.v = torch.nn.Linear(c, c, bias=bias)
        self.o = torch.nn.Linear(c, c, bias=bias)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, s, c))


class SliceCat(torch.nn.Module):
    """Split the channels at ``k``, treat the two parts differently, concatenate back."""

    def __init__(self, c, k, first, second):
        super().__init__()
        self.k = k
        self.first, self.second = first, second

    def forward(self, x):
        return torch.cat([self.first(x[..., : self.k]), self.second(x[..., self.k:])], dim=-1)


class NoRule(torch.nn.Module):
    """An op symgraph has no rule for (``torch.sort`` over the channels)."""

    def forward(self, x):
        return torch.sort(x, dim=-1).values


class Net(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


# --- strategies ---------------------------------------------------------------------------
@st.composite
def width_block(draw, c, depth):
    """A block mapping width ``c`` to width ``c``."""
    choices = ["linear", "act", "norm", "gate"]
    if c >= 2:
        choices.append("slicecat")
    if c % 2 == 0:
        choices.append("attention")
    if depth < 2:
        choices.append("residual")
    what = draw(st.sampled_from(choices))
    bias = draw(st.booleans())
    if what == "linear":
        return torch.nn.Linear(c, c, bias=bias)
    if what == "act":
        return Act(draw(st.sampled_from(sorted(Act.FNS))))
    if what == "norm":
        return torch.nn.LayerNorm(c, elementwise_affine=draw(st.booleans()))
    if what == "gate":
        return Gate(c, draw(st.integers(2, 6)), draw(st.sampled_from(sorted(Act.FNS))), bias)
    if what == "attention":
        heads = draw(st.sampled_from([h for h in (1, 2, c // 2) if c % h == 0]))
        return Attention(c, heads, bias, draw(st.booleans()))
    if what == "slicecat":
        k = draw(st.integers(1, c - 1))
        first = draw(width_block(k, depth + 1)) if depth < 2 else Act("relu")
        second = draw(st.sampled_from(sorted(Act.FNS)))
        return SliceCat(c, k, first, Act(second))
    inner = [draw(width_block(c, depth + 1)) for _ in range(draw(st.integers(1, 3)))]
    return Residual(torch.nn.Sequential(*inner))


@st.composite
def networks(draw):
    c0 = draw(st.integers(2, 5))
    c = draw(st.sampled_from([4, 6, 8]))
    blocks = [torch.nn.Linear(c0, c, bias=draw(st.booleans()))]
    n = draw(st.integers(1, 5))
    norule_at = draw(st.integers(0, n))
    for i in range(n + 1):
        if i == norule_at:
            blocks.append(NoRule())
        if i < n:
            blocks.append(draw(width_block(c, 0)))
    blocks.append(torch.nn.Linear(c, 3, bias=draw(st.booleans())))
    seed = draw(st.integers(0, 2 ** 16))
    torch.manual_seed(seed)
    net = Net(blocks)
    for p in net.parameters():  # biases too: zero biases would hide bias-slot mistakes
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(B, S, c0, generator=torch.Generator().manual_seed(seed))
    return net, x


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(networks())
def test_random_networks_certify(net_x):
    net, x = net_x
    report = symgraph.analyze(net, inputs=(x,))
    # the op without a rule is reported, by name
    assert any(f.op == str(NORULE_OP) for f in report.frozen), report.frozen
    # soundness: one random element of every group at once leaves the outputs unchanged
    worst = report.certify(net, inputs=(x,), trials=2)
    assert worst <= 1e-6

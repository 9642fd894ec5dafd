"""Values whose size depends on the data (``x[mask]``): their sizes are taken from the example
inputs (passes/concrete.py); the masked axes are fixed, the channels pass through."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, keep):
        h = torch.relu(self.a(x))[keep]  # [rows kept, 6]
        return self.b(h).sum(0)


def test_boolean_mask_selection():
    torch.manual_seed(0)
    m = Masked().double().eval()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    keep = torch.tensor([[True, False, True, True, False], [False, True, True, False, False]])
    r = symgraph.analyze(m, (x, keep))
    assert r.frozen == [] and r.certify(m, (x, keep)) < 1e-12
    (hidden,) = r.group_of("a.weight", 0)
    assert hidden.kind == "scaled_perm" and ("b.weight", 1) in hidden.params
    assert r.group_of("b.weight", 0) == []  # the model's output
    ep = r.exported_program
    sizes = [tuple(n.meta["val"].shape) for n in ep.graph.nodes if n.op == "call_function"
             and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].shape[-1:] == (6,)
             and n.meta["val"].dim() == 2]
    assert (int(keep.sum()), 6) in sizes  # the kept rows, as the example inputs kept them


class SharedBias(nn.Module):
    """Scores plus a constant bias that is the same for every head (zeros plus a causal mask,
    as T5's cross-attention adds): the heads stay free, permutations only."""

    def __init__(self, d=8, h=2):
        super().__init__()
        self.h, self.q, self.k, self.v, self.o = h, nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        B, S, D = x.shape
        split = lambda t: t.view(B, S, self.h, D // self.h).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        causal = torch.full((S, S), -1e9, dtype=x.dtype).triu(1)[None, None]
        bias = torch.zeros(1, self.h, S, S, dtype=x.dtype) + causal  # the same for every head
        w = torch.softmax(q @ k.transpose(-1, -2) + bias, -1)
        return self.o((w @ v).transpose(1, 2).reshape(B, S, D))


def test_constant_bias_shared_by_heads_keeps_them_free():
    torch.manual_seed(0)
    m = SharedBias().double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < 1e-12
    heads = [g for g in r.group_of("q.weight", 0) if g.kind == "perm"]
    assert [g.size for g in heads] == [2] and heads[0] in r.group_of("o.weight", 1)

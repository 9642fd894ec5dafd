"""Tiny modules several tests build: a Switch-style mixture of experts (a top-1 router and a
loop over the experts it picked), one rotary attention layer whose tables and rotation a test
chooses, and an MLP with an extra projection taken only when a mask marks some token."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One expert: ``width → 16 → width``, a ReLU between."""

    def __init__(self, width: int):
        super().__init__()
        self.wi, self.wo = nn.Linear(width, 16, bias=False), nn.Linear(16, width, bias=False)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class ExpertLoop(nn.Module):
    """A top-1 router and a loop over the experts it picked, each named by its index (Switch
    Transformers): ``for e in hit: self.experts[f"expert_{e[0]}"]``; a residual around them."""

    def __init__(self, width: int, n: int = 3):
        super().__init__()
        self.router = nn.Linear(width, n, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": Expert(width) for i in range(n)})

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        picked = nn.functional.one_hot(self.router(flat).argmax(-1), len(self.experts))
        out = torch.zeros_like(flat)
        for e in (picked.sum(0) > 0).nonzero():
            rows = picked[:, e[0]].nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.experts[f"expert_{e[0]}"](flat[rows]))
        return (flat + out).reshape(x.shape)


class RotaryAttention(nn.Module):
    """One attention layer (``heads`` of ``hd``, width ``d``) whose queries and keys turn by
    ``rotate(x, cos, sin)`` with ``(cos, sin) = tables(pos, hd)``, a residual and a 3-way output;
    ``torch.manual_seed(seed)`` first."""

    def __init__(self, tables, rotate, d=16, heads=2, hd=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.h, self.hd, self.tables, self.rotate = heads, hd, tables, rotate
        self.q, self.k, self.v = (nn.Linear(d, heads * hd) for _ in range(3))
        self.o, self.out = nn.Linear(heads * hd, d), nn.Linear(d, 3)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        cos, sin = self.tables(pos, self.hd)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(x + self.o(a.transpose(1, 2).reshape(b, s, -1)))


class MaskBranch(nn.Module):
    """An MLP (6 → 12 → 6) whose output gets an extra term (:meth:`extra_term`, from a 6 → 6
    projection) only when the mask marks some token: a branch on a value of the data (LED,
    Longformer's global attention)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.extra = nn.Linear(6, 12), nn.Linear(12, 6), nn.Linear(6, 6)

    def forward(self, x, mask):
        h = self.down(torch.relu(self.up(x)))
        if mask.flatten().any().item():
            h = self.extra_term(h, x, mask)
        return h

    def extra_term(self, h, x, mask):
        """``h`` with the extra projection of ``x`` added (a subclass may add it elsewhere)."""
        return h + self.extra(x)


def experts_claimed(model: ExpertLoop, x) -> None:
    """``model`` analysed on ``x``: each expert's 16 hidden units one class (a permutation, or
    scaled: ReLU) that its own ``wo`` reads, and the certificate holds."""
    import symgraph
    rep = symgraph.analyze(model, (x,))
    for i in range(len(model.experts)):
        (hidden,) = [g for g in rep.groups if (f"experts.expert_{i}.wi.weight", 0) in g.params]
        assert hidden.kind in ("perm", "scaled_perm") and hidden.size == 16
        assert (f"experts.expert_{i}.wo.weight", 1) in hidden.params
    assert rep.certify(model, (x,)) <= 1e-6


def recovered_by_weights(model, rep, inputs) -> None:
    """``model`` moved by a random element of ``rep``'s groups (its weights change by more
    than 10%, its outputs on ``inputs`` do not) is aligned back by weights with full groups
    (within 1e-5)."""
    import symgraph
    from test_families_full_groups import _rel
    B = symgraph.transform(model, rep.random_transform(seed=1))
    assert _rel(model, B) > 0.1
    assert rep.certify(B, inputs) <= 1e-6
    al = symgraph.align(model, B, inputs, report_a=rep, full_groups=True)
    assert _rel(model, al.apply(B)) < 1e-5

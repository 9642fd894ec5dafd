"""``where(c, a, b)``: along an axis the condition is broadcast on, each position takes ``a``'s
vector or ``b``'s whole, and any map both take commutes with it (a mask token put in place of
masked positions keeps a stream's full group); along an axis the condition varies on, or with a
number for a value, it is elementwise nonlinear (permutations only). Each certified."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph


class Select(nn.Module):
    """``where`` between two linear maps of ``x`` under a mask of ``mode``: ``"positions"``
    (the same for every channel), ``"channels"`` (one per entry), or ``"number"`` (a value 0.5)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.a, self.b, self.head = nn.Linear(6, 16), nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        if self.mode == "positions":
            y = torch.where((x[..., :1] > 0), a, b)
        elif self.mode == "channels":
            y = torch.where(a > b, a, b)
        else:
            y = torch.where(x[..., :1] > 0, a + b, 0.5)
        return self.head(y)


def _stream(mode):
    torch.manual_seed(0)
    m, x = Select(mode).eval(), torch.randn(2, 5, 6)
    rep = symgraph.analyze(m, (x,))
    (g,) = rep.group_of("a.weight", 0)
    assert rep.group_of("b.weight", 0) == [g]
    assert rep.certify(m, (x,)) <= 1e-6
    return g


def test_a_condition_broadcast_over_channels_keeps_the_full_group():
    g = _stream("positions")
    assert g.kind == "gl" and g.size == 16


def test_a_condition_varying_over_channels_keeps_permutations_only():
    assert _stream("channels").kind == "perm"


def test_a_number_for_a_value_keeps_permutations_only():
    assert _stream("number").kind == "perm"

"""Issue 65 (timm coverage): Hiera pools its tokens by a max over a view of the token axis,
``x.view(B, stride, -1, C).amax(dim=1)`` (timm's ``do_pool``). ``amax`` has one overload, which
takes ``dim``: it was read as a maximum over every axis, so the pooled channels were left in a
class of their own and the report claimed a permutation that changes the output (0.6 on Hiera).
The channel axis passes through the maximum over the stride axis: one class with the branch it
is added to and the map that reads it."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph


class TokenMaxPool(nn.Module):
    """A projection pooled over token windows by ``amax`` on a view, added to a projection of
    the kept tokens, a ReLU, a read-out: Hiera's stage transition in small."""

    def __init__(self, d=4, c=6):
        super().__init__()
        self.proj = nn.Linear(d, c)
        self.branch = nn.Linear(d, c)
        self.out = nn.Linear(c, 3)

    def forward(self, x):
        b, n, _ = x.shape
        y = self.proj(x)
        y = y.view(b, 2, -1, y.shape[-1]).amax(dim=1)
        return self.out(torch.relu(y + self.branch(x[:, : n // 2])))


def _setup():
    torch.manual_seed(0)
    m = TokenMaxPool().eval()
    return m, torch.randn(2, 8, 4)


def test_max_over_a_token_window_keeps_the_channel_class():
    m, x = _setup()
    rep = symgraph.analyze(m, (x,))
    slots = {("proj.weight", 0), ("proj.bias", 0), ("branch.weight", 0), ("branch.bias", 0), ("out.weight", 1)}
    hit = [g for g in rep.groups if slots & set(g.params)]
    assert len(hit) == 1 and slots <= set(hit[0].params), [(g.kind, g.params) for g in rep.groups]
    assert hit[0].kind in ("perm", "scaled_perm") and hit[0].dim == 6
    assert rep.certify(m, (x,)) < 1e-12


def test_amax_over_every_dim():
    """A maximum over every axis: each meets ``perm``, the output is a scalar."""
    class AllMax(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 5)

        def forward(self, x):
            return torch.relu(self.a(x)).amax(dim=(0, 1)) * 2.0
    m = AllMax().eval()
    x = torch.randn(3, 4)
    rep = symgraph.analyze(m, (x,))
    assert rep.certify(m, (x,)) < 1e-12
    assert [g.kind for g in rep.groups if ("a.weight", 0) in g.params] == ["perm"]


def test_pooled_channels_recovered_by_weights():
    m, x = _setup()
    rep = symgraph.analyze(m, (x,))
    moved = symgraph.transform(m, rep.random_transform(seed=3))
    assert float((moved.proj.weight - m.proj.weight).abs().max()) > 0.1  # really moved
    with torch.no_grad():
        assert torch.allclose(moved(x), m(x), atol=1e-5)
    back = symgraph.align(m, moved, (x,)).apply(moved)
    for name, p in m.state_dict().items():
        assert torch.allclose(back.state_dict()[name], p, atol=1e-6), name

"""Issue 65 (timm coverage): halo attention (timm's byoanet) cuts its keys into overlapping
windows with ``Tensor.unfold`` along the spatial axes, which had no rule: its channels were
frozen. The windows' axes are fixed (order matters), the channel axis passes through."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph


class Windows(nn.Module):
    """A convolution, a ReLU, overlapping windows along height and width, a mean over them,
    a read-out."""

    def __init__(self, c=6):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 1)
        self.out = nn.Linear(c, 2)

    def forward(self, x):
        y = torch.relu(self.conv(x)).unfold(2, 3, 1).unfold(3, 3, 2)  # [B, C, h', w', 3, 3]
        y = (y * torch.linspace(0.5, 1.5, 3)).amax(-1)                 # order inside a window matters
        return self.out(y.mean((2, 3, 4)))


def _setup():
    torch.manual_seed(0)
    return Windows().eval(), torch.randn(2, 3, 6, 7)


def test_unfold_passes_the_channels_and_fixes_the_windows():
    m, x = _setup()
    rep = symgraph.analyze(m, (x,))
    slots = {("conv.weight", 0), ("conv.bias", 0), ("out.weight", 1)}
    hit = [g for g in rep.groups if slots & set(g.params)]
    assert len(hit) == 1 and slots <= set(hit[0].params), [(g.kind, g.params) for g in rep.groups]
    assert hit[0].kind in ("perm", "scaled_perm")
    assert "aten.unfold" not in " ".join(str(f.op) for f in rep.frozen)
    assert rep.certify(m, (x,)) < 1e-12


def test_window_channels_recovered_by_weights():
    m, x = _setup()
    rep = symgraph.analyze(m, (x,))
    moved = symgraph.transform(m, rep.random_transform(seed=4))
    assert float((moved.conv.weight - m.conv.weight).abs().max()) > 0.1
    back = symgraph.align(m, moved, (x,)).apply(moved)
    for name, p in m.state_dict().items():
        assert torch.allclose(back.state_dict()[name], p, atol=1e-6), name

"""``grid_sampler_2d`` (deformable attention's sampling): any map of the sampled channels
passes through it, the batch axis is shared with the positions, and the coordinates stay fixed."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import symgraph


class Sampled(torch.nn.Module):
    """Values sampled at positions predicted from the same tokens, as deformable attention."""

    def __init__(self):
        super().__init__()
        self.v, self.off, self.o = torch.nn.Linear(6, 8), torch.nn.Linear(6, 2), torch.nn.Linear(8, 3)

    def forward(self, x):  # [2, 5 tokens, 6]
        v = self.v(x).transpose(1, 2).reshape(2, 8, 1, 5)
        grid = torch.tanh(self.off(x)).reshape(2, 5, 1, 2)
        y = F.grid_sample(v, grid, align_corners=False).reshape(2, 8, 5).transpose(1, 2)
        return self.o(torch.relu(y))


def test_sampled_channels_keep_their_class():
    torch.manual_seed(0)
    m, x = Sampled().double().eval(), (torch.randn(2, 5, 6, dtype=torch.float64),)
    r = symgraph.analyze(m, x)
    (g,) = r.group_of("v.weight", 0)
    assert g.kind == "scaled_perm" and g.size == 8 and ("o.weight", 1) in g.params
    assert r.group_of("off.weight", 0) == []  # the coordinates are fixed
    assert r.certify(m, x) < 1e-12
    moved = symgraph.transform(m, r.random_transform(seed=1))
    assert not torch.allclose(moved.v.weight, m.v.weight)
    assert torch.allclose(moved(*x), m(*x), atol=1e-12)

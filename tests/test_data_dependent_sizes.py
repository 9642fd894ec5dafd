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

"""A repeat whose count the program computes (a value read from data, as HunYuan-VL's
vision positions are repeated per image): the number of copies is unknown, so the repeated axis
and the axis it copies are fixed, with the reason; the analysis no longer fails on it."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph


class Repeats(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.other = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(4, 5)

    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= 4)
        h = torch.relu(self.up(x)).repeat(k, 1)  # (k * rows, 6): copies of every hidden row
        return self.down(h).sum(0) + 0 * torch.relu(self.other(x)).sum()


def test_a_computed_repeat_count_fixes_the_copied_axis():
    torch.manual_seed(0)
    model = Repeats().double().eval()
    inputs = (torch.randn(3, 4, dtype=torch.float64), torch.tensor(2))
    report = symgraph.analyze(model, inputs)
    assert report.certify(model, inputs) < 1e-12
    held = {(p, d) for g in report.groups for p, d in g.params}
    # the hidden units are copied along the repeated rows, not along their own axis: a repeat
    # of dim 0 fixes only dim 0 (rows), so up's hidden units keep their class
    assert ("up.weight", 0) in held and ("other.weight", 0) in held

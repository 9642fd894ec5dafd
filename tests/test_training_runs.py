"""Issue 65, training runs (:mod:`symgraph.passes.training_runs`): a block whose auxiliary head is
read only ``if self.training`` (as a detection decoder scores every layer only for its auxiliary
losses) leaves the head unread in eval mode, which fixed every class. The trace runs the block
again in training mode, its own flag alone: its dropout child stays off, so the run is the same
function in every run. The head's input axis then joins the hidden units' class, the certificate
judges the training run, and the program still computes the plain eval forward."""
from __future__ import annotations

import torch
from torch import nn

import symgraph
from symgraph.passes.training_runs import TrainingRun, training_runs
from symgraph.report.certify import extra_runs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.aux = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)))
        if self.training:
            return self.down(h), self.aux(h)
        return self.down(h), None


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)[0]


def test_a_head_read_only_in_training_joins_the_hidden_class():
    torch.manual_seed(0)
    m, x = Gated().eval(), torch.randn(5, 4)
    assert training_runs(m, (x,), {}, ["block.aux.weight", "block.aux.bias"]) == [TrainingRun("block")]
    assert training_runs(m, (x,), {}, ["block.aux.weight", "block.never"]) == []  # one left unread: none
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and extra_runs(rep) == [TrainingRun("block")]
    (hidden,) = rep.group_of("block.up.weight", 0)
    assert hidden.kind == "scaled_perm" and hidden.size == 6
    assert rep.group_of("block.aux.weight", 1) == [hidden] and rep.group_of("block.down.weight", 1) == [hidden]
    assert rep.group_of("block.aux.weight", 0) == []  # its outputs are the run's results: fixed
    assert not any(mod.training for mod in m.modules())  # every flag restored
    with torch.no_grad():
        assert torch.equal(rep.exported_program.module()(x), m(x))
    assert rep.certify(m) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=1))
    with torch.no_grad():
        assert torch.allclose(moved.block.aux(torch.relu(moved.block.up(x))), m.block.aux(torch.relu(m.block.up(x))),
                              atol=1e-5)

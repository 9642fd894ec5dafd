"""An LSTM's hidden units (timm's Sequencer): the four gates of ``weight_ih``/``weight_hh``
rows, ``weight_hh``'s columns and the next layer's input permute together. Its zero initial
state is unbound per layer and taken by ``getitem``: still zeros, which fix nothing; a state the
caller passes is an input, which fixes the units. Mapping, certificate, recovery by weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph

from function_helpers import assert_recovered
from rules_helpers import analyze, x_of


class Seq(nn.Module):
    def __init__(self, layers=1, bidirectional=False, hidden=6):
        super().__init__()
        self.rnn = nn.LSTM(8, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.fc = nn.Linear(hidden * (2 if bidirectional else 1), 3)

    def forward(self, x, state=None):
        y, _ = self.rnn(x, state)
        return self.fc(y)


def _slots(report):
    return {(g.kind, g.size): {s for s in g.params} for g in report.groups}


def _layer(name, sfx=""):
    return {(f"rnn.weight_ih_{name}{sfx}", 0), (f"rnn.weight_hh_{name}{sfx}", 0),
            (f"rnn.weight_hh_{name}{sfx}", 1), (f"rnn.bias_ih_{name}{sfx}", 0),
            (f"rnn.bias_hh_{name}{sfx}", 0)}


def test_hidden_units_are_one_permutation_class():
    r = analyze(Seq(), x_of(2, 5, 8))
    assert _slots(r) == {("perm", 6): _layer("l0") | {("fc.weight", 1)}}
    assert r.frozen == []


def test_two_layers_both_directions():
    r = analyze(Seq(layers=2, bidirectional=True), x_of(2, 4, 8))
    classes = sorted(sorted(g.params) for g in r.groups)
    assert all(g.kind == "perm" and g.size == 6 for g in r.groups) and len(r.groups) == 4
    for name, sfx in (("l0", ""), ("l0", "_reverse"), ("l1", ""), ("l1", "_reverse")):
        assert any(_layer(name, sfx) <= set(c) for c in classes), (name, sfx)
    # the first layer's two directions are read by the second layer's inputs, side by side
    assert {("rnn.weight_ih_l1", 1), ("rnn.weight_ih_l1_reverse", 1)} <= set().union(*map(set, classes))


def test_a_state_the_caller_passes_fixes_the_units():
    m, x = Seq(), x_of(2, 5, 8)
    state = (x_of(1, 2, 6), x_of(1, 2, 6))
    report = symgraph.analyze(m, (x, state))
    assert report.groups == [] and report.certify(m, (x, state)) <= 1e-6


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.slow
def test_permuted_copy_recovered_by_weights(bidirectional):
    model, x = Seq(bidirectional=bidirectional).eval(), x_of(2, 5, 8)
    report = analyze(model, x)
    moved = symgraph.transform(model, report.random_transform(seed=2))
    with torch.no_grad():
        assert torch.allclose(moved(x), model(x), atol=1e-6)
    assert not torch.equal(moved.rnn.weight_hh_l0, model.rnn.weight_hh_l0)
    assert_recovered(model, moved, (x,))

"""A rule that pairs axes of different sizes (a rule bug for that node's shapes) freezes its
node and says so in the report, instead of stopping the analysis with an AssertionError from
the union-find; the report stays sound and the rest of the model keeps its classes."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import UnsupportedOpError
from symgraph.passes import registry
from symgraph.passes.registry import Unify

aten = torch.ops.aten


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 6)
        self.c = torch.nn.Linear(6, 5)
        self.d = torch.nn.Linear(5, 6)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.d(torch.relu(self.c(torch.neg(h))))


@pytest.fixture
def broken_neg(monkeypatch):
    """aten.neg's rule replaced by one that pairs the output's last axis with the input's first."""
    def rule(ctx):
        x = ctx.arg(0)
        return [Unify(ctx.out[-1], ctx.axes(x)[0])]
    monkeypatch.setitem(registry._RULES, aten.neg.default, rule)


def test_a_rule_pairing_axes_of_different_sizes_freezes_its_node(broken_neg):
    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    r = symgraph.analyze(net, (x,))
    (f,) = r.frozen
    assert f.op == "aten.neg.default" and f.why == "the rule for aten.neg.default paired axes of sizes 6 and 3"
    assert f.to_dict()["why"] == f.why
    assert "1 ops whose rule failed" in r.summary() and "a symgraph rule bug" in r.summary()
    assert r.certify(net, (x,)) < 1e-10
    # the hidden units of a and c keep their classes; the axes the failed op touched are fixed
    assert [g.size for g in r.group_of("a.weight", 0)] == [8]
    assert [g.size for g in r.group_of("c.weight", 0)] == [5]
    assert r.group_of("b.weight", 0) == []
    with pytest.raises(UnsupportedOpError, match="paired axes of sizes 6 and 3 at node neg"):
        symgraph.analyze(net, (x,), strict=True)


def test_without_the_broken_rule_nothing_is_frozen():
    net = Net().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    r = symgraph.analyze(net, (x,))
    assert r.frozen == [] and "0 ops without a rule" in r.summary()
    assert [g.size for g in r.group_of("b.weight", 0)] == [6]

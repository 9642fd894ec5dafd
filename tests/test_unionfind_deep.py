"""A time axis cut one sample apart twice (a convolution's shifted slices: ``x[1:]`` beside
``x[:-1]``, a reflect pad's pieces) refines over as many levels as it has samples: Apertus
1.5's audio tokenizer on half a second of audio nests its structure 12,000 deep. The union-find
queues its parts' merges and the analysis walks the leaves without recursing, so neither
overflows Python's stack (both did: ``RecursionError``)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

import symgraph
from symgraph.passes.driver import AxisAnalysis
from symgraph.passes.unionfind import AxisUnionFind

from test_holder_inputs import recovered


def test_a_cut_shifted_by_one_refines_to_single_samples_without_recursing():
    n = 3 * sys.getrecursionlimit()
    uf = AxisUnionFind()
    a = uf.new(n)
    later, earlier = uf.new(n - 1), uf.new(n - 1)
    uf.add_structure(a, "sum", [uf.new(1), later])  # x[1:]
    uf.add_structure(a, "sum", [earlier, uf.new(1)])  # x[:-1]
    uf.union(later, earlier)  # x[1:] - x[:-1]: one class, so each cut repeats inside the other
    leaves = AxisAnalysis.leaves(SimpleNamespace(uf=uf), a)
    assert len(leaves) == n and all(uf.size[r] == 1 for r in leaves)
    assert len(set(leaves)) == 1  # each sample in the class of the next: one class
    assert AxisAnalysis.leaves(SimpleNamespace(uf=uf), later) == leaves[1:]  # the same samples


class _Differenced(torch.nn.Module):
    """A hidden axis read as ``h[1:] - h[:-1]`` (a finite difference: nothing but the identity
    commutes with the shift, and its structure nests as deep as the axis is long), beside an
    MLP whose hidden units permute."""

    def __init__(self, n: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, n), torch.nn.Linear(n - 1, 3)
        self.c, self.d = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h[..., 1:] - h[..., :-1]) + self.d(torch.relu(self.c(x)))


def test_a_model_whose_axis_nests_deeper_than_the_stack_is_analysed_and_aligned():
    """The report's queries walk the structure too (its stored slots, coordinate tables,
    matrices, trees): each overflowed Python's stack at 3,000 deep (``RecursionError``)."""
    n = 3 * sys.getrecursionlimit()
    torch.manual_seed(0)
    m, x = _Differenced(n).double().eval(), torch.randn(2, 4, dtype=torch.float64)
    rep = symgraph.analyze(m, (x,))
    assert [(g.kind, g.size) for g in rep.group_of("c.weight", 0)] == [("scaled_perm", 6)]  # relu: positive scales
    assert rep.group_of("a.weight", 0) == []  # only the identity commutes with a shift
    tree = rep.axis_tree(rep.param_axes("b.weight")[1])
    depth, todo, leaves = 0, [(tree, 0)], 0
    while todo:
        (kind, *rest), d = todo.pop()
        depth = max(depth, d)
        leaves += kind == "leaf"
        todo += [(t, d + 1) for t in rest[0]] if kind != "leaf" else []
    assert leaves == n - 1 and depth > sys.getrecursionlimit()  # walked, not recursed into
    assert rep.certify(m, (x,)) <= 1e-9
    assert recovered(m, rep, (x,)) < 1e-9

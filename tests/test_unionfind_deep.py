"""A time axis cut one sample apart twice (a convolution's shifted slices: ``x[1:]`` beside
``x[:-1]``, a reflect pad's pieces) refines over as many levels as it has samples: Apertus
1.5's audio tokenizer on half a second of audio nests its structure 12,000 deep. The union-find
queues its parts' merges and the analysis walks the leaves without recursing, so neither
overflows Python's stack (both did: ``RecursionError``)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

from symgraph.passes.driver import AxisAnalysis
from symgraph.passes.unionfind import AxisUnionFind


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

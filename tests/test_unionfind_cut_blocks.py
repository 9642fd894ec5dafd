"""The union-find's class that is both a concatenation and a product of blocks cut inside a block
(a UNet's skip connection joined to its up path, then normalised in groups that straddle the
join): the blocks stay in place and each block's channels split at the cuts' offsets, one
element per segment repeated in every block, instead of the whole class fixed."""
from __future__ import annotations

import pytest

from symgraph.passes.unionfind import AxisUnionFind


def _sizes(uf, axis):
    r, _ = uf.find(axis)
    kind, parts = uf.struct[r]
    return kind, [uf.size[uf.find(p)[0]] for p, _ in parts]


@pytest.mark.parametrize("prod_first", [False, True])
def test_groups_straddling_a_join(prod_first):
    uf = AxisUnionFind()
    r, q1, q2, groups, inner = uf.new(24), uf.new(16), uf.new(8), uf.new(4), uf.new(6)
    uf.meet(inner, "perm", "channels within a group")
    steps = [lambda: uf.add_structure(r, "sum", [q1, q2]), lambda: uf.add_structure(r, "prod", [groups, inner])]
    for step in (steps[::-1] if prod_first else steps):
        step()
    assert uf.kind[uf.find(groups)[0]] == "identity"  # a group never moves whole
    assert _sizes(uf, inner) == ("sum", [4, 2])  # the join at 16 falls 4 channels into group 2
    assert _sizes(uf, r) == ("sum", [4, 2] * 4)
    assert _sizes(uf, q1) == ("sum", [4, 2, 4, 2, 4]) and _sizes(uf, q2) == ("sum", [2, 4, 2])
    # the same segment classes in every block: one element of the inner class, repeated
    parts = [uf.find(p)[0] for p, _ in uf.struct[uf.find(r)[0]][1]]
    assert parts[0::2] == [parts[0]] * 4 and parts[1::2] == [parts[1]] * 4 and parts[0] != parts[1]
    assert uf.kind.get(uf.find(r)[0], "gl") != "identity"


def test_a_product_of_three_parts_cut_inside_a_block_is_still_fixed():
    uf = AxisUnionFind()
    r, q1, q2 = uf.new(24), uf.new(16), uf.new(8)
    uf.add_structure(r, "sum", [q1, q2])
    uf.add_structure(r, "prod", [uf.new(2), uf.new(2), uf.new(6)])
    assert uf.kind[uf.find(r)[0]] == "identity" and "incompatible structures" in uf.reasons[uf.find(r)[0]][-1][1]

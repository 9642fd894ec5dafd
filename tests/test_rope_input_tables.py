"""RoPE whose tables are computed from the caller's inputs, written as diffusers writes it.

Flux, CogVideoX and HunyuanDiT take position ids as an input and rotate by
``x·cos + stack([-x₁, x₀], -1).flatten(-2)·sin`` with ``x₀, x₁ = x.reshape(..., -1, 2).unbind(-1)``:
pairs ``(2i, 2i+1)``, the tables ``repeat_interleave``d so both coordinates of a pair turn by one
angle. No map acts on the inputs, so a table computed from them alone (no parameter on the way)
is as good as a constant: the rope group is found, certified and recovered. A table that is not
pair-symmetric by construction (a different angle per coordinate) is no rotation: no rope group.
"""
from __future__ import annotations

import torch

import symgraph
from analyze_helpers import TOL, in_layer, names, one
from tiny_modules import RotaryAttention, recovered_by_weights


def _tables(pos, n, paired=True):
    """cos/sin of each position's angles, each angle repeated for a pair (diffusers'
    ``get_1d_rotary_pos_embed(..., repeat_interleave_real=True)``), or one per coordinate."""
    inv = 1.0 / 100.0 ** (torch.arange(0, n, 2 if paired else 1, dtype=pos.dtype) / n)
    f = pos[..., None] * inv
    if paired:
        f = f.repeat_interleave(2, dim=-1)
    return f.cos()[:, None], f.sin()[:, None]


def rotate(x, cos, sin):  # diffusers' apply_rotary_emb(use_real_unbind_dim=-1)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return x * cos + x_rotated * sin


def Tiny(paired=True, **kw):
    """One attention layer turned by :func:`_tables` (``paired``) as diffusers' :func:`rotate`."""
    return RotaryAttention(lambda pos, hd: _tables(pos, hd, paired), rotate, **kw)


def _inputs(seed=0, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, 16, generator=g), torch.rand(b, s, generator=g) * 7


def test_tables_from_input_positions_give_rope_pairs_of_neighbours():
    m = Tiny().eval()
    x, pos = _inputs()
    rep = symgraph.analyze(m, inputs=(x, pos))
    assert rep.frozen == []
    rope = one([g for g in in_layer(rep.groups, "") if g.kind == "rope"], "rope group")
    assert (rope.blocks, rope.dim) == (2, 8)
    assert rope.pairs == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert any(g.kind == "perm" and g.size == 2 for g in rep.groups)  # the heads
    assert rep.certify(m, (x, pos)) <= TOL


def test_tables_from_input_positions_recovered_by_weights():
    m = Tiny().eval()
    x, pos = _inputs()
    recovered_by_weights(m, symgraph.analyze(m, inputs=(x, pos)), (x, pos))


def test_tables_not_pair_symmetric_are_no_rotation():
    """One angle per coordinate: ``R`` still squares to ``-I`` but the tables turn the two
    coordinates of a pair by different angles; no rotation of a pair commutes with that."""
    m = Tiny(paired=False).eval()
    x, pos = _inputs()
    rep = symgraph.analyze(m, inputs=(x, pos))
    assert not [g for g in rep.groups if g.kind == "rope"]
    assert rep.certify(m, (x, pos)) <= TOL
    # the heads still permute; within a head, q's and k's rows are fixed
    assert [(g.kind, g.size) for g in rep.groups if "q.weight" in names(g)] == [("perm", 2)]

"""RoPE whose tables vision-language models build by writing into them in place.

Interleaved M-RoPE (Qwen3-VL's ``apply_interleaved_mrope``, Cosmos3-Edge, HunYuan-VL) computes
one angle table per position axis (temporal, height, width) and overwrites every third
frequency of the temporal table with the other axes' (``f[..., 1:k:3] = g[..., 1:k:3]``), then
doubles it (``cat((f, f), -1)``) for ``rotate_half``'s pairs ``(i, i + d/2)``. Traced, the
in-place writes are ``select``, ``copy``, ``slice_scatter`` and ``where``: read through, the
tables are still pair-symmetric by construction, so the rope group is found, certified and
recovered by weights. A write into one half only (after the doubling) breaks the pairs: no rope.

Qwen2.5-VL-style vision towers (EXAONE 4.5) build 2-D tables (``cat`` of the height and width
angles, doubled) and reorder their rows into attention windows (``emb.view(n, u, -1)[window]``,
``aten.index`` on a leading dim): read through, the pairs stand; an index on the last axis that
mixes the halves is no rotation table.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from analyze_helpers import TOL, in_layer, names, one
from tiny_modules import RotaryAttention, recovered_by_weights


def _tables(pos, hd, section=(2, 1, 1), rewrite=None):
    """cos/sin from ``pos`` (3, batch, seq): Qwen3-VL's interleaved M-RoPE, in place; then
    ``rewrite`` the doubled table's first angles from the height axis in both halves
    (``"both"``: pairs kept) or in the first half only (``"half"``: pairs broken)."""
    inv = 1.0 / 100.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = pos[..., None].float() * inv  # (3, b, s, hd/2)
    f = freqs[0]
    for dim, offset in ((1, 1), (2, 2)):
        idx = slice(offset, section[dim] * 3, 3)
        f[..., idx] = freqs[dim, ..., idx]
    emb = torch.cat((f, f), dim=-1)
    if rewrite is not None:
        height = torch.cat((freqs[1], freqs[1]), dim=-1)
        emb[..., :2] = height[..., :2]
        if rewrite == "both":
            emb[..., 4:6] = height[..., 4:6]
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def Tiny(rewrite=None, **kw):
    """One attention layer turned by :func:`_tables` (``rewrite``) in ``rotate_half``'s pairs."""
    return RotaryAttention(lambda pos, hd: _tables(pos, hd, rewrite=rewrite),
                           lambda x, cos, sin: x * cos + rotate_half(x) * sin, **kw)


def _inputs(seed=0, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, 16, generator=g), torch.randint(0, 9, (3, b, s), generator=g)


@pytest.mark.parametrize("rewrite", [None, "both"])
def test_interleaved_mrope_written_in_place_gives_rotate_half_pairs(rewrite):
    """``None``: Qwen3-VL's form (the doubling makes the pairs); ``"both"``: the pairs hold
    only through what ``slice_scatter`` writes into each half."""
    m = Tiny(rewrite=rewrite).eval()
    x, pos = _inputs()
    rep = symgraph.analyze(m, inputs=(x, pos))
    rope = one([g for g in in_layer(rep.groups, "") if g.kind == "rope"], "rope group")
    assert (rope.blocks, rope.dim) == (2, 8)
    assert rope.pairs == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert {"q.weight", "k.weight"} <= set(names(rope))
    assert any(g.kind == "perm" and g.size == 2 for g in rep.groups)  # the heads
    assert rep.certify(m, (x, pos)) <= TOL


def test_interleaved_mrope_written_in_place_recovered_by_weights():
    m = Tiny(rewrite="both").eval()
    x, pos = _inputs()
    recovered_by_weights(m, symgraph.analyze(m, inputs=(x, pos)), (x, pos))


def test_write_into_one_half_breaks_the_pairs():
    """``emb[..., :2] = ...`` after the doubling: pairs (0, 4) and (1, 5) turn by different
    angles, so no rotation of them commutes with the tables: no rope group, still sound."""
    m = Tiny(rewrite="half").eval()
    x, pos = _inputs()
    rep = symgraph.analyze(m, inputs=(x, pos))
    assert not [g for g in rep.groups if g.kind == "rope"]
    assert rep.certify(m, (x, pos)) <= TOL
    assert [(g.kind, g.size) for g in rep.groups if "q.weight" in names(g)] == [("perm", 2)]


class Windowed(nn.Module):
    """A vision block on 8 patches of a 4×2 grid: axial tables, rows reordered into windows."""

    def __init__(self, d=16, heads=2, hd=8, mix=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.h, self.hd, self.mix = heads, hd, mix
        self.qkv, self.o = nn.Linear(d, 3 * heads * hd), nn.Linear(heads * hd, d)
        self.register_buffer("window", torch.tensor([1, 0, 3, 2]), persistent=False)
        self.register_buffer("cols", torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), persistent=False)

    def _tables(self, s):
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(2), indexing="ij"), -1)
        inv = 1.0 / 100.0 ** (torch.arange(0, self.hd // 2, 2, dtype=torch.float32) / (self.hd // 2))
        f = grid.reshape(s, 2, 1).float() * inv  # (s, 2, hd/4): height, width
        emb = torch.cat((f[:, 0], f[:, 1]), -1)
        emb = torch.cat((emb, emb), -1).view(s // 2, 2, -1)[self.window].reshape(s, -1)
        if self.mix:  # coordinates of the table interleaved: (i, i + d/2) no longer share an angle
            emb = emb[:, self.cols]
        return emb.cos()[:, None], emb.sin()[:, None]

    def forward(self, x):
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.h, self.hd).unbind(1)
        cos, sin = self._tables(s)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)))
        return x + self.o(a.transpose(0, 1).reshape(s, -1))


def _patches(seed=0):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


def test_window_reordered_axial_tables_give_rotate_half_pairs():
    m = Windowed().eval()
    x = _patches()
    rep = symgraph.analyze(m, inputs=(x,))
    rope = one([g for g in rep.groups if g.kind == "rope"], "rope group")
    assert (rope.blocks, rope.dim) == (2, 8)
    assert rope.pairs == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert rep.certify(m, (x,)) <= TOL
    recovered_by_weights(m, rep, (x,))


def test_index_on_the_table_coordinates_is_no_rotation():
    m = Windowed(mix=True).eval()
    x = _patches()
    rep = symgraph.analyze(m, inputs=(x,))
    assert not [g for g in rep.groups if g.kind == "rope"]
    assert rep.certify(m, (x,)) <= TOL

"""DeepSeek's interleaved RoPE (``cat([x[0::2]·cos - x[1::2]·sin, x[1::2]·cos + x[0::2]·sin])``,
transformers' ``apply_rotary_pos_emb_interleave``) where its query and key meet in products
rather than ``scaled_dot_product_attention``: eager attention's ``q @ k.transpose(-1, -2)`` and
a DeepSeek sparse attention indexer's ``relu(q @ kᵀ)`` (HY-V4), with rotary tables computed from
position ids the caller gives (multimodal RoPE computes them from the input ids).

The output holds pair ``p`` at ``(p, p + d/2)``; where both operands of every contraction carry
that move on the contracted axis, the scores undo it and the class keeps the stored pairs
``(2i, 2i+1)`` (:mod:`symgraph.passes.patterns.rope_twist`). Where they do not (``q @ k``
without the transpose, a key in another layout), nothing is claimed and the report stays sound.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from analyze_helpers import TOL, in_layer, one
from test_families_full_groups import _rel

ROT, NOPE, HEADS, D = 8, 4, 2, 16


def _interleave(x, cos, sin):
    return torch.cat([x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 1::2] * cos + x[..., 0::2] * sin], -1)


def _halves(x, cos, sin):  # the same rotation on pairs (i, i + d/2): another layout
    n = x.shape[-1] // 2
    return torch.cat([x[..., :n] * cos - x[..., n:] * sin, x[..., n:] * cos + x[..., :n] * sin], -1)


class Block(nn.Module):
    """Multi-head attention whose heads are ``NOPE`` pass-through then ``ROT`` rotary
    coordinates, scores by ``q @ kᵀ`` (``key="t"``), or by ``q @ k`` reshaped square
    (``key="no_t"``: a contraction of q's rotary axis with k's sequence axis), plus an
    indexer's scores ``relu(qi @ kiᵀ)`` choosing the keys each query sees (top-k) (``indexer=True``)."""

    def __init__(self, key="t", key_rope=_interleave, indexer=False):
        super().__init__()
        hd = NOPE + ROT
        self.key, self.key_rope, self.indexer = key, key_rope, indexer
        self.norm = nn.RMSNorm(D)
        self.q, self.k = nn.Linear(D, HEADS * hd), nn.Linear(D, HEADS * hd)
        self.v, self.o = nn.Linear(D, HEADS * 6), nn.Linear(HEADS * 6, D)
        if indexer:
            self.qi, self.ki, self.wi = nn.Linear(D, 2 * ROT, bias=False), nn.Linear(D, ROT), nn.Linear(D, 2)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.norm(x)
        q, k = (p(y).view(b, s, HEADS, -1).transpose(1, 2) for p in (self.q, self.k))
        v = self.v(y).view(b, s, HEADS, -1).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [NOPE, ROT], -1)
        k_pass, k_rot = torch.split(k, [NOPE, ROT], -1)
        c, sn = cos[:, None], sin[:, None]
        q = torch.cat([q_pass, _interleave(q_rot, c, sn)], -1)
        k = torch.cat([k_pass, self.key_rope(k_rot, c, sn)], -1)
        if self.key == "t":
            scores = q @ k.transpose(-1, -2)
        else:  # s == NOPE + ROT here: q's coordinates contract with k's positions
            scores = q @ k
        mask = torch.full((s, s), float("-inf")).triu(1)
        if self.indexer:
            qi = self.qi(y).view(b, s, 2, ROT)
            ki = self.ki(y)[:, :, None]
            qi, ki = _interleave(qi, cos[:, :, None], sin[:, :, None]), _interleave(ki, cos[:, :, None], sin[:, :, None])
            idx = torch.relu(qi.transpose(1, 2) @ ki.squeeze(2).transpose(-1, -2).unsqueeze(1))
            index = (self.wi(y).transpose(1, 2)[..., None] * idx).sum(1)
            dropped = torch.ones_like(index, dtype=torch.bool).scatter(-1, index.topk(s // 2, -1).indices, False)
            mask = torch.where(dropped[:, None], -1e4, mask)
        a = torch.softmax(scores * 0.25 + mask, -1) @ v
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, seed=0, **kw):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(32, D)
        self.block = Block(**kw)
        self.head = nn.Linear(D, 32)
        with torch.no_grad():
            self.block.norm.weight.uniform_(0.5, 1.5)

    def forward(self, ids, positions):
        # the tables from the caller's positions: computed from an input, not constants
        f = positions[..., None].float() * (1.0 / 100.0 ** (torch.arange(0, ROT, 2) / ROT))
        return self.head(self.block(self.emb(ids), f.cos(), f.sin()))


def _inputs(seed, b=2, s=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (b, s), generator=g)
    return ids, torch.arange(s)[None].expand(b, s) + torch.randint(0, 5, (b, 1), generator=g)


def _rope(rep):
    return [g for g in in_layer(rep.groups, "block.") if g.kind == "rope"]


@pytest.mark.parametrize("indexer", [False, True], ids=["eager", "eager_and_indexer"])
def test_interleaved_rope_in_products_keeps_stored_pairs(indexer):
    """Query and key rotated alike meet in ``q @ kᵀ`` (and the indexer's): a rope class on
    the stored pairs of each head's rotary rows; certified, and a transformed copy recovered
    exactly by weights."""
    A = Model(indexer=indexer).eval()
    x = _inputs(0)
    rep = symgraph.analyze(A, inputs=x)
    assert rep.frozen == []
    ropes = _rope(rep)
    main = one([g for g in ropes if any(p == "block.k.weight" for p, _ in g.params)], "attention's rope")
    assert (main.blocks, main.dim, main.pairs) == (HEADS, ROT, ((0, 1), (2, 3), (4, 5), (6, 7)))
    if indexer:
        ind = one([g for g in ropes if g is not main], "the indexer's rope")
        assert (ind.dim, ind.pairs) == (ROT, ((0, 1), (2, 3), (4, 5), (6, 7)))
        assert {p for p, _ in ind.params} == {"block.qi.weight", "block.ki.weight", "block.ki.bias"}
    assert rep.certify(A, x) <= TOL
    B = symgraph.transform(A, rep.random_transform(seed=1))
    assert _rel(A, B) > 0.1 and rep.certify(B, x) <= TOL
    al = symgraph.align(A, B, x, report_a=rep, full_groups=True)
    assert _rel(A, al.apply(B)) < 1e-5


@pytest.mark.parametrize("case", [dict(key="no_t"), dict(key_rope=_halves)], ids=["q_at_k", "key_in_halves"])
def test_interleaved_rope_claims_nothing_where_the_move_does_not_cancel(case):
    """``q @ k`` contracts q's rotary coordinates with k's positions; a key in the halves
    layout is not moved like the query. Either way the move stays in the scores: no rope class
    on the query, and whatever is claimed is a symmetry."""
    A = Model(**case).eval()
    x = _inputs(0, s=NOPE + ROT)
    rep = symgraph.analyze(A, inputs=x)
    assert not [g for g in _rope(rep) if any(p == "block.q.weight" for p, _ in g.params)]
    assert rep.certify(A, x) <= TOL

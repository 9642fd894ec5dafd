"""Issue 65: a packed QKV projection taken apart after views that merge axes (SAM's attention,
in Unlimited-OCR's, GOT-OCR 2's and DeepSeek-VL-Hybrid's vision towers: ``qkv(x)`` of a
``(B, h, w, C)`` map viewed ``(B, h·w, 3, H, d)``, permuted, merged ``(3, B·H, h·w, d)`` and
unbound) is a split: Q, K and V each get their own part of the packed axis, so V/O has a
class per head even where Q/K share one across heads (a relative-position table read by every
head's queries)."""
from __future__ import annotations

import torch
from torch import nn

import symgraph

C, H = 16, 4


class SamAttention(nn.Module):
    def __init__(self, rel_pos: bool):
        super().__init__()
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.rel_pos = nn.Parameter(torch.randn(5, C // H)) if rel_pos else None

    def forward(self, x):
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h * w, 3, H, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * H, h * w, -1).unbind(0)
        scores = q @ k.transpose(-2, -1) * (C // H) ** -0.5
        if self.rel_pos is not None:  # every head's queries read one table: Q/K shared by heads
            scores = scores + (q @ self.rel_pos.T).sum(-1, keepdim=True)
        out = torch.softmax(scores, dim=-1) @ v
        out = out.view(b, H, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, C)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, rel_pos: bool):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(C), SamAttention(rel_pos)

    def forward(self, x):
        return x + self.attn(self.norm(x))


def _analysed(rel_pos: bool):
    torch.manual_seed(0)
    m = Block(rel_pos).eval()
    x = torch.randn(2, 3, 3, C)
    r = symgraph.analyze(m, x)
    assert r.certify(m, x) < 1e-6
    return m, r


def test_packed_axis_is_three_parts_and_vo_is_per_head():
    _, r = _analysed(rel_pos=False)
    assert r.axis_structure(r.param_axes("attn.qkv.weight")[0]) == ("sum", [C, C, C])
    per_head = [g for g in r.group_of("attn.proj.weight", 1) if g.blocks == H]
    assert per_head and all(g.kind != "identity" for g in per_head)


def test_shared_query_table_leaves_vo_per_head():
    _, r = _analysed(rel_pos=True)
    vo = [g for g in r.group_of("attn.proj.weight", 1) if g.blocks == H]
    assert vo and vo[0].size == C
    # the table's width is the queries' head width, one map for every head
    (table,) = r.group_of("attn.rel_pos", 1)
    assert table.blocks == 1 and table.size == C // H

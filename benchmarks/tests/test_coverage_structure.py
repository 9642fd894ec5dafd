"""Issue 46, part 2: the coverage benchmark's completeness check, read from the graph.

- multi-query attention (one key/value head broadcast to every query head): no class can be
  per head, so the heads are complete as one permutation class of head blocks (GPT-BigCode,
  Falcon); grouped-query and multi-head attention still need a per-head class;
- RoPE where every rotated query is normalised first by a norm the rotations cannot pass (a
  mean-subtracting norm, or an RMS norm followed by per-dimension gains): no rope class can
  exist, and the row says so instead of calling the family incomplete (as where the graph
  rotates nothing at all). An RMS norm without
  gains (rotations keep norms), or a norm on the coordinates that are not rotated, blocks
  nothing: RoPE is still expected there."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from benchmarks import coverage as cov
from benchmarks.coverage.attention import attention_units
from symgraph.passes.trace import trace


@pytest.mark.parametrize("fam", [("gpt_bigcode", "GPTBigCodeForCausalLM"), ("persimmon", "PersimmonForCausalLM"),
                                 ("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_rows(fam):
    r = cov.run_family(*fam, "causal_lm")
    st = r["structure"]
    assert r["sound"] and r["certificate"] < 1e-12 and r["complete"] and st["missing"] == []
    assert st["multi_query"] == (2 if fam[0] == "gpt_bigcode" else 0)
    blocked = fam[0] in ("persimmon", "qwen3")  # query/key norms with per-dimension gains
    assert bool(st.get("rope_blocked")) == blocked and st["rope_expected"] == (fam[0] != "gpt_bigcode" and not blocked)
    assert st["rope_classes"] == (2 if fam[0] == "llama" else 0)


def test_rope_absent_from_the_graph_is_not_missing():
    """The tiny Flint keeps its first two layers, full attention without positional encoding
    (only its sliding-window layers rotate): the rotary embedding is computed, reaches no
    attention, and no rope class can exist."""
    r = cov.run_family("flint", "FlintForCausalLM", "causal_lm")
    st = r["structure"]
    assert r["complete"] and st["missing"] == [] and st["rope_blocked"] == cov.ROPE_ABSENT


def _rotate(x, s):
    n = x.shape[-1]
    f = torch.arange(s)[:, None] / 100.0 ** (torch.arange(0, n, 2) / n)[None]
    cos, sin = torch.cat([f.cos()] * 2, -1), torch.cat([f.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., n // 2:], x[..., : n // 2]], -1) * sin


class Attn(nn.Module):
    """One attention layer, 4 heads of 8 (the last 4 coordinates rotated); ``norm``: ``"gain"``
    (RMS norm with gains on the whole query head), ``"plain"`` (RMS norm, no gains),
    ``"pass"`` (RMS norm with gains on the 4 coordinates that are not rotated)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.g = nn.Parameter(torch.rand(8) + 0.5)
        self.gp = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.norm == "gain":
            q = self.g * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))
        elif self.norm == "plain":
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
        elif self.norm == "pass":
            qp = q[..., :4]
            q = torch.cat([self.gp * (qp * torch.rsqrt(qp.pow(2).mean(-1, keepdim=True) + 1e-6)), q[..., 4:]], -1)
        q = torch.cat([q[..., :4], _rotate(q[..., 4:], s)], -1)
        k = torch.cat([k[..., :4], _rotate(k[..., 4:], s)], -1)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, s, 32))


@pytest.mark.parametrize("norm,blocked", [("gain", True), ("plain", False), ("pass", False), (None, False)])
def test_query_norm_blocks_rope_only_with_gains_on_rotated_coordinates(norm, blocked):
    ep = trace(Attn(norm).eval(), (torch.randn(2, 6, 32),))[0]
    (unit,) = attention_units(ep)
    assert (unit["heads"], unit["kv_heads"], unit["rotated"], unit["qk_norm"]) == (4, 4, True, blocked)


class SharedInside(nn.Module):
    """Two heads of 8 whose queries, keys and values each pass one depthwise kernel and one
    norm shared by both heads (MViTv2's pooling attention, tokens as a 2x2 grid): the heads
    permute, but no map acts on one head alone. ``bias``: a fixed score offset per head, which
    tells the heads apart (no head permutation is left)."""

    def __init__(self, bias=False):
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.pool = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.bias = bias

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        def pool(t):
            t = self.pool(t.reshape(-1, 2, 2, 8).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
            return self.norm(t.reshape(b, 2, s, 8))
        q, k, v = pool(q), pool(k), pool(v)
        scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
        if self.bias:  # a constant of the program, not a buffer (a buffer moves with the heads)
            scores = scores + torch.tensor([0.0, 1.5]).view(1, 2, 1, 1)
        a = scores.softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("bias", [False, True])
def test_heads_sharing_a_map_inside_are_complete_as_a_head_permutation(bias):
    """Heads that share their inner maps are complete through a class of the head count on a
    factor of the projection's axis (the report holds no class with head blocks); with the
    heads told apart, that class is gone and the site is missing."""
    import symgraph
    torch.manual_seed(0)
    model, x = SharedInside(bias).eval(), (torch.randn(2, 4, 16),)
    report = symgraph.analyze(model, x)
    assert report.certify(model, x) < 1e-12
    assert not any(g.blocks > 1 for g in report.groups)
    heads = [g for g in report.groups if g.dim == 2 and ("qkv.weight", 0) in g.params]
    assert len(heads) == (0 if bias else 1)
    st = cov.expectations(trace(model, x)[0], report, types.SimpleNamespace())  # no config
    assert st["multihead_attention"] == 1
    assert [m["kind"] for m in st["missing"]] == (["attention-heads"] if bias else [])
    if not bias:  # the head permutation is recovered by weights
        moved = symgraph.transform(model, report.random_transform(seed=1, orthogonal=True))
        back = symgraph.align(model, moved, x).apply(moved)
        assert max(float((a - b).abs().max()) for a, b in
                   zip(model.state_dict().values(), back.state_dict().values())) < 1e-6

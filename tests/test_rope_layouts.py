"""RoPE layouts beyond ``x·cos + rotate_half(x)·sin``, read from the graph (no names):

- complex multiplication (Llama 4, DeepSeek-V2: ``view_as_real(view_as_complex(x.view(..., d/2,
  2)) * freqs_cis)``): pairs ``(2i, 2i+1)``, with head permutations as in real RoPE;
- concatenated per-pair forms that keep x's layout (``cat([x₁c - x₂s, x₂c + x₁s])`` on the
  halves, sliced or by ``torch.chunk`` as GPT-OSS takes them): pairs ``(i, i + d/2)``;
- DeepSeek-V3's ``rope_interleave`` (``cat`` of the even/odd slices' rotations) moves pair
  ``p`` from ``(2p, 2p+1)`` to ``(p, p + d/2)``; query and key alike, so attention's scores
  undo the move: pairs ``(2i, 2i+1)`` as stored (:mod:`symgraph.passes.patterns.rope_twist`);
- scaled tables (YaRN's attention factor, llama3, longrope, linear): the same classes as
  plain RoPE.

Each: the exact pairs and slots of the rope group, the certificate, and (a transformed copy)
exact recovery by weights and by activations with ``full_groups=True``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as tf

import symgraph
from analyze_helpers import TOL, in_layer, one, slots
from test_families_full_groups import _batches, _rel


# --- a tiny decoder with a pluggable rotary form --------------------------------------------
def _angles(s, n):
    inv = 1.0 / 100.0 ** (torch.arange(0, n, 2, dtype=torch.float32) / n)
    return torch.arange(s, dtype=torch.float32)[:, None] * inv[None]


def rope_complex(q, k, s):  # Llama 4's apply_rotary_emb (q, k: [b, h, s, n])
    f = _angles(s, q.shape[-1])
    cis = torch.polar(torch.ones_like(f), f) * 0.9  # an attention factor, as YaRN's
    return [torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
                               * cis[None, None]).flatten(3).type_as(x) for x in (q, k)]


def rope_halves_cat(q, k, s):  # rotate_half written as one concatenation
    n = q.shape[-1]
    f = _angles(s, n)
    cos, sin = f.cos()[None, None], f.sin()[None, None]
    return [torch.cat([x[..., : n // 2] * cos - x[..., n // 2:] * sin,
                       x[..., n // 2:] * cos + x[..., : n // 2] * sin], -1) for x in (q, k)]


def rope_deepseek_interleave(q, k, s):  # DeepSeek-V3's apply_rotary_pos_emb_interleave
    n = q.shape[-1]
    emb = torch.cat([_angles(s, n)] * 2, -1)
    cos, sin = emb.cos()[None, None, :, : n // 2], emb.sin()[None, None, :, : n // 2]
    return [torch.cat([x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 1::2] * cos + x[..., 0::2] * sin], -1)
            for x in (q, k)]


def rope_chunk_cat(q, k, s):  # GPT-OSS's _apply_rotary_emb: the halves by torch.chunk
    f = _angles(s, q.shape[-1])
    cos, sin = f.cos()[None, None], f.sin()[None, None]
    out = []
    for x in (q, k):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return out


def rope_chunk_rotate_half(q, k, s):  # x·cos + rotate_half(x)·sin, rotate_half by chunk (ESM)
    f = torch.cat([_angles(s, q.shape[-1])] * 2, -1)
    cos, sin = f.cos()[None, None], f.sin()[None, None]
    out = []
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        out.append(x * cos + torch.cat((-x2, x1), dim=-1) * sin)
    return out


ROPES = {"complex": rope_complex, "halves_cat": rope_halves_cat, "deepseek": rope_deepseek_interleave,
         "chunk_cat": rope_chunk_cat, "chunk_rotate_half": rope_chunk_rotate_half}


class Block(nn.Module):
    """Pre-norm attention, GQA (``kv`` key heads), each head ``nope`` pass-through then ``rot``
    rotary coordinates (DeepSeek's split), values of another width."""

    def __init__(self, d, heads, kv, nope, rot, vdim, rope):
        super().__init__()
        self.h, self.kv, self.nope, self.rot, self.rope = heads, kv, nope, rot, rope
        self.norm = nn.RMSNorm(d)
        self.q, self.k = nn.Linear(d, heads * (nope + rot)), nn.Linear(d, kv * (nope + rot))
        self.v, self.o = nn.Linear(d, kv * vdim), nn.Linear(heads * vdim, d)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.norm(x)
        q, k, v = (p(y).view(b, s, n, -1).transpose(1, 2) for p, n in ((self.q, self.h), (self.k, self.kv), (self.v, self.kv)))
        q_pass, q_rot = torch.split(q, [self.nope, self.rot], -1)
        k_pass, k_rot = torch.split(k, [self.nope, self.rot], -1)
        q_rot, k_rot = ROPES[self.rope](q_rot, k_rot, s)
        q, k = torch.cat([q_pass, q_rot], -1), torch.cat([k_pass, k_rot], -1)
        r = self.h // self.kv
        k, v = (t[:, :, None].expand(b, self.kv, r, s, t.shape[-1]).reshape(b, self.h, s, -1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


class TinyDecoder(nn.Module):
    def __init__(self, rope, layers=1, vocab=32, d=24, heads=4, kv=2, nope=4, rot=8, vdim=6, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = dict(heads=heads, kv=kv, nope=nope, rot=rot)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv, nope, rot, vdim, rope) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _ids(seed, shape=(2, 10)):
    return torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(seed))


def _recovers(A, rep, inputs=None, data=None):
    """A random transform of A (certified) merged back into A by weights and by activations."""
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    args = () if inputs is None else (inputs,)
    assert rep.certify(B, *args) <= TOL
    for d in (None, data):
        al = symgraph.align(A, B, *args, data=d, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-5, "weights" if d is None else "activations"


def _tiny_rope_group(rep, cfg, pre):
    """The rope group of block ``pre``: its blocks are the key heads, its slots the rotary rows
    of Q (co) and K (contra); head permutations (key heads, query heads within a group) exist."""
    groups = in_layer(rep.groups, pre)
    rope = one([g for g in groups if g.kind == "rope"], "rope group")
    assert (rope.blocks, rope.dim) == (cfg["kv"], cfg["rot"])
    assert slots(rope) == {(pre + p, 0) for p in ("q.weight", "q.bias", "k.weight", "k.bias")}
    kv = one([g for g in groups if g.kind == "perm" and g.size == cfg["kv"]], "key-head perm")
    qh = one([g for g in groups if g.kind == "perm" and g.size == cfg["heads"]], "query heads in a group")
    nope = one([g for g in groups if g.kind == "gl" and g.dim == cfg["nope"]], "pass-through QK")
    assert rope.outer == nope.outer == qh.outer == [kv.id]
    return rope


# --- complex multiplication --------------------------------------------------------------------
def test_complex_rope_pairs_neighbours_and_keeps_head_permutations():
    A = TinyDecoder("complex").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    assert rep.frozen == []
    rope = _tiny_rope_group(rep, A.cfg, "blocks.0.")
    assert rope.pairs == ((0, 1), (2, 3), (4, 5), (6, 7))
    # the pairs are rows nope + 2i, nope + 2i + 1 of each key head's block of k.weight
    (idx, nf), = rep.leaf_views(rep.param_axes("blocks.0.k.weight")[0], rope.id)
    hd = A.cfg["nope"] + A.cfg["rot"]
    want = torch.tensor([[h * hd + A.cfg["nope"] + j for j in range(A.cfg["rot"])] for h in range(A.cfg["kv"])])
    assert torch.equal(torch.as_tensor(idx).reshape(want.shape), want)
    assert rep.certify(A, _ids(0)) <= TOL


def test_complex_rope_outside_a_rotary_form_is_sound():
    """``view_as_complex``/``view_as_real`` elsewhere: their rules (not the RoPE pattern) share
    the complex axes and fix the (re, im) axis; a product of two complex activations keeps only
    permutations of the complex coordinates."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            z = torch.view_as_complex(self.a(x).reshape(*x.shape[:-1], 4, 2))
            return self.b(torch.view_as_real(z * z).flatten(-2))

    m = M()
    rep = symgraph.analyze(m, inputs=(torch.randn(3, 8),))
    assert rep.frozen == [] and [(g.kind, g.size) for g in rep.groups] == [("perm", 4)]
    assert rep.certify(m, torch.randn(3, 8)) <= TOL


def test_complex_rope_tiny_recovered_by_weights_and_activations():
    A = TinyDecoder("complex").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    _recovers(A, rep, _ids(0), [(_ids(i, (4, 12)),) for i in range(3)])


# --- concatenated forms -----------------------------------------------------------------------
def test_concatenated_halves_rotation_pairs_i_with_i_plus_half():
    A = TinyDecoder("halves_cat").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    rope = _tiny_rope_group(rep, A.cfg, "blocks.0.")
    assert rope.pairs == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert rep.certify(A, _ids(0)) <= TOL


@pytest.mark.parametrize("form", ["chunk_cat", "chunk_rotate_half"])
@pytest.mark.slow
def test_chunked_halves_rotation_pairs_i_with_i_plus_half(form):
    """The halves taken by ``torch.chunk`` (a ``split`` in the graph: GPT-OSS's
    ``cat((x₁c - x₂s, x₂c + x₁s))``, ESM's ``rotate_half``) of the rotary part that a
    ``torch.split`` cut from each head: pairs ``(i, i + rot/2)`` on rows ``nope + i`` and
    ``nope + i + rot/2`` of each key head; certified, and a transformed copy recovered exactly
    by weights and by activations."""
    A = TinyDecoder(form).eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    assert rep.frozen == []
    rope = _tiny_rope_group(rep, A.cfg, "blocks.0.")
    assert rope.pairs == ((0, 4), (1, 5), (2, 6), (3, 7))
    (idx, nf), = rep.leaf_views(rep.param_axes("blocks.0.k.weight")[0], rope.id)
    hd = A.cfg["nope"] + A.cfg["rot"]
    want = torch.tensor([[h * hd + A.cfg["nope"] + j for j in range(A.cfg["rot"])] for h in range(A.cfg["kv"])])
    assert torch.equal(torch.as_tensor(idx).reshape(want.shape), want)
    assert rep.certify(A, _ids(0)) <= TOL
    _recovers(A, rep, _ids(0), [(_ids(i, (4, 12)),) for i in range(3)])


def test_deepseek_interleave_pairs_neighbours_as_stored():
    """``cat([x[0::2]·cos - x[1::2]·sin, x[1::2]·cos + x[0::2]·sin])``: output pair ``(p, p+d/2)``
    is input pair ``(2p, 2p+1)``; the query and the key move alike and meet only in attention's
    scores, which undo the move: a rope class on the stored pairs, per key head."""
    A = TinyDecoder("deepseek").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    rope = _tiny_rope_group(rep, A.cfg, "blocks.0.")
    assert rope.pairs == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert rep.certify(A, _ids(0)) <= TOL


@pytest.mark.slow
def test_deepseek_interleave_recovered_by_weights_and_activations():
    A = TinyDecoder("deepseek").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    _recovers(A, rep, _ids(0), [(_ids(i, (4, 12)),) for i in range(3)])


# --- Hugging Face families ----------------------------------------------------------------------
V = 64
_T = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, max_position_embeddings=32)
ROPE_TYPES = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, rope_theta=10000.0,
                 attention_factor=0.8, beta_fast=16, beta_slow=2),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8, rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
}


def llama4_text():
    """Llama 4's text decoder, dense, layer 0 with RoPE through complex numbers (and the L2
    query/key norm after it), layer 1 without RoPE (NoPE)."""
    cfg = tf.Llama4TextConfig(**{**_T, "intermediate_size_mlp": 64}, head_dim=8, moe_layers=[], no_rope_layers=[1, 0])
    return tf.Llama4ForCausalLM(cfg).eval()


def _hf_rope(rep, pre, heads, kv, head_dim, pairs):
    groups = in_layer(rep.groups, pre)
    rope = one([g for g in groups if g.kind == "rope"], "rope group")
    assert (rope.blocks, rope.dim, rope.pairs) == (kv, head_dim, pairs)
    assert {p for p, _ in rope.params} >= {pre + "q_proj.weight", pre + "k_proj.weight"}
    kvp = one([g for g in groups if g.kind == "perm" and g.size == kv], "key-head perm")
    qh = one([g for g in groups if g.kind == "perm" and g.size == heads], "query heads in a group")
    assert rope.outer == qh.outer == [kvp.id]
    return rope


def test_llama4_complex_rope_layer_has_rope_pairs_and_head_permutations_like_its_nope_layer():
    A = llama4_text()
    rep = symgraph.analyze(A)
    assert rep.frozen == []
    _hf_rope(rep, "model.layers.0.self_attn.", 4, 2, 8, tuple((2 * i, 2 * i + 1) for i in range(4)))
    nope = in_layer(rep.groups, "model.layers.1.self_attn.")
    assert not [g for g in nope if g.kind == "rope"]
    for pre in ("model.layers.0.self_attn.", "model.layers.1.self_attn."):  # head perms in both
        kinds = sorted((g.kind, g.size, g.blocks) for g in in_layer(rep.groups, pre) if g.kind == "perm")
        assert kinds == [("perm", 2, 1), ("perm", 4, 2)], (pre, kinds)
    assert rep.certify(A) <= TOL


@pytest.mark.parametrize("kind", list(ROPE_TYPES))
def test_scaled_rope_tables_give_plain_rope_classes(kind):
    A = tf.LlamaForCausalLM(tf.LlamaConfig(**_T, rope_parameters=ROPE_TYPES[kind])).eval()
    rep = symgraph.analyze(A)
    for i in range(2):
        _hf_rope(rep, f"model.layers.{i}.self_attn.", 4, 2, 8, tuple((j, j + 4) for j in range(4)))
    assert rep.frozen == [] and rep.certify(A) <= TOL


@pytest.mark.slow
def test_llama4_text_recovered_by_weights_and_activations():
    A = llama4_text()
    _recovers(A, symgraph.analyze(A), data=_batches(A))


@pytest.mark.slow
def test_qwen2_yarn_recovered_by_weights_and_activations():
    A = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_T, rope_parameters=ROPE_TYPES["yarn"])).eval()
    rep = symgraph.analyze(A)
    _hf_rope(rep, "model.layers.0.self_attn.", 4, 2, 8, tuple((j, j + 4) for j in range(4)))
    _recovers(A, rep, data=_batches(A))


@pytest.mark.slow
def test_concatenated_halves_recovered_by_weights_and_activations():
    A = TinyDecoder("halves_cat").eval()
    rep = symgraph.analyze(A, inputs=(_ids(0),))
    _recovers(A, rep, _ids(0), [(_ids(i, (4, 12)),) for i in range(3)])


@pytest.mark.slow
def test_deepseek_v3_rope_interleave_is_certified():
    """The real family of the moving layout (multi-head latent attention): whatever is claimed
    is a symmetry."""
    cfg = tf.DeepseekV3Config(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=16,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              max_position_embeddings=32, rope_interleave=True)
    A = tf.DeepseekV3ForCausalLM(cfg).eval()
    rep = symgraph.analyze(A)
    assert rep.certify(A) <= TOL

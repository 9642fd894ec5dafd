"""Coverage of architecture families no other test names (issue 14): Swin (window attention:
padding, rolls and window partitions on token axes), BART (cross-attention, the encoder and
decoder streams), CLIP (two towers and a shared L2-normalised embedding space), a DBRX-style
fused Wqkv with grouped K/V. Each is certified in float64, has the groups it must have, and a
transformed copy is recovered exactly by weight matching.

Hidden states a model also returns (BART's ``encoder_last_hidden_state``, CLIP's towers) are
left out of a head model's default outputs; kept (``outputs="all"``), they fix their streams.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")

CERT = 1e-9


def pixels(size=32):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def ids(n=7):
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(0))


def recovered(model, report, inputs, seed=3, **options):
    """A copy moved by a random element of every group, aligned back by weight matching."""
    moved = symgraph.transform(model, report.random_transform(seed=seed, orthogonal=True))
    al = symgraph.align(model, moved, inputs, outputs=report.outputs, **options)
    got, want, was = al.apply(moved).state_dict(), model.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    return max((got[k] - want[k]).abs().max().item() for k in want)


def kinds(report, prefix=""):
    return sorted((g.kind, g.dim, g.blocks) for g in report.groups if g.module.startswith(prefix))


def only(report, param, dim):
    (g,) = report.group_of(param, dim)
    return g



def swin_config():
    return transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[2, 4],
                                   window_size=2, num_labels=5)


def clip_config():
    return transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                           num_attention_heads=4, image_size=16, patch_size=4),
        projection_dim=8)


def mamba2_config():
    return transformers.Mamba2Config(vocab_size=64, hidden_size=16, state_size=8, num_hidden_layers=1,
                                     num_heads=4, head_dim=8, expand=2, n_groups=1, chunk_size=4, use_cache=False)


@pytest.mark.slow
def test_swin():
    cfg = swin_config()
    m = randomized(transformers.SwinForImageClassification(cfg))
    x = {"pixel_values": pixels()}
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < CERT
    # per block: heads, QK and VO per head, MLP hidden; a stream per stage (patch merging
    # changes the width); shifted windows (roll, pad) leave the channels alone
    blk = "swin.encoder.layers.1.blocks.1"
    assert kinds(r, blk) == [("gl", 4, 4), ("gl", 4, 4), ("perm", 4, 1), ("perm", 64, 1)]
    s0, s1 = only(r, "swin.embeddings.patch_embeddings.projection.weight", 0), only(r, "classifier.weight", 1)
    assert (s0.kind, s0.size, s1.kind, s1.size) == ("perm", 8, "perm", 16)
    # patch merging concatenates 4 neighbours of stage 0's stream: its input is 4 copies of it
    merge_in = r.param_axes("swin.encoder.layers.0.downsample.reduction.weight")[1]
    assert r.axis_structure(merge_in) == ("sum", [8, 8, 8, 8]) and r.axis_groups(merge_in) == [s0.id] * 4
    assert recovered(m, r, x) < 1e-9


def bart():
    cfg = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=24, decoder_ffn_dim=20, max_position_embeddings=32,
                                  use_cache=False)
    return randomized(transformers.BartForConditionalGeneration(cfg))


@pytest.mark.slow
def test_bart_cross_attention_and_streams():
    m, x = bart(), {"input_ids": ids()}
    full = symgraph.analyze(m, x, outputs="all")  # encoder_last_hidden_state too: the stream is fixed
    assert full.frozen == [] and full.group_of("model.shared.weight", 1) == []
    r = symgraph.analyze(m, x)  # a head model's default: its outputs other than hidden states
    assert r.outputs == ("logits",) and r.frozen == [] and r.certify(m, x) < CERT
    # one stream: the shared embedding ties encoder, decoder and head
    stream = only(r, "model.shared.weight", 1)
    assert stream.kind == "perm" and stream.size == 16
    assert {("model.encoder.layers.0.fc2.weight", 0), ("model.decoder.layers.0.fc2.weight", 0),
            ("model.decoder.layers.0.encoder_attn.k_proj.weight", 1)} <= set(stream.params)
    # cross-attention: its own heads, QK (decoder queries, encoder keys) and VO classes
    attn = "model.decoder.layers.0.encoder_attn"
    heads, qk = sorted(r.group_of(f"{attn}.q_proj.weight", 0), key=lambda g: g.kind != "perm")
    assert r.group_of(f"{attn}.k_proj.weight", 0) == r.group_of(f"{attn}.q_proj.weight", 0)
    assert (heads.kind, heads.size, qk.kind, qk.dim, qk.blocks) == ("perm", 4, "gl", 4, 4)
    (vo,) = [g for g in r.group_of(f"{attn}.v_proj.weight", 0) if g != heads]
    assert vo.kind == "gl" and vo != qk and (f"{attn}.out_proj.weight", 1) in vo.params
    self_heads = [g for g in r.group_of("model.decoder.layers.0.self_attn.q_proj.weight", 0) if g.kind == "perm"]
    assert self_heads and heads not in self_heads
    assert only(r, "model.decoder.layers.0.fc1.weight", 0).size == 20
    assert recovered(m, r, x) < 1e-9
    moved = symgraph.transform(m, r.random_transform(seed=4, orthogonal=True))
    merged = symgraph.merge([m, moved], x, outputs=["logits"]).model.state_dict()
    assert max((merged[k] - v).abs().max().item() for k, v in m.state_dict().items()) < 1e-9
    with pytest.raises(symgraph.InputError, match="no output 'logitz'"):
        symgraph.analyze(m, x, outputs=["logitz"])


def test_clip_towers_and_shared_embedding_space():
    cfg = clip_config()
    m = randomized(transformers.CLIPModel(cfg))
    x = {"input_ids": ids(), "pixel_values": pixels(16)}
    r = symgraph.analyze(m, x, outputs=["logits_per_image", "logits_per_text"])
    assert r.frozen == [] and r.certify(m, x) < CERT
    text = only(r, "text_model.embeddings.token_embedding.weight", 1)
    vision = only(r, "vision_model.embeddings.patch_embedding.weight", 0)
    assert text != vision and text.size == vision.size == 16
    # the embeddings are L2-normalised before their dot product: any rotation of the shared
    # projection space keeps the logits
    space = only(r, "text_projection.weight", 0)
    assert space.kind == "orthogonal" and ("visual_projection.weight", 0) in space.params
    assert recovered(m, r, x) < 1e-9


class FusedGQA(nn.Module):
    """DBRX-style attention: one Wqkv emits Q (4 heads) and K, V (2 heads each), split by
    sizes; K and V repeated for their query groups."""

    def __init__(self, d=16, h=4, kv=2):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.emb = nn.Linear(5, d)
        self.Wqkv = nn.Linear(d, d + 2 * kv * self.hd, bias=False)
        self.o, self.head = nn.Linear(d, d, bias=False), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.attend(self.emb(x)))

    def attend(self, h):
        B, T, _ = h.shape
        q, k, v = self.Wqkv(h).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        q = q.view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = (t.view(B, T, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
                for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return h + self.o(a)


def test_fused_qkv_with_grouped_kv():
    torch.manual_seed(0)
    m, x = FusedGQA().eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < CERT
    assert r.axis_structure(r.param_axes("Wqkv.weight")[0]) == ("sum", [16, 8, 8])
    # K/V heads (2), query heads within a group (2 per K/V head), QK and VO maps per K/V head
    assert kinds(r) == [("gl", 4, 2), ("gl", 4, 2), ("gl", 16, 1), ("perm", 2, 1), ("perm", 2, 2)]
    heads = [g for g in r.groups if g.kind == "perm" and g.blocks == 1]
    assert len(heads) == 1 and heads[0].size == 2 and ("o.weight", 1) in heads[0].params
    assert {(g.kind, g.size, g.blocks) for g in r.groups if ("o.weight", 1) in g.params
            and g.blocks == 2} >= {("gl", 8, 2), ("perm", 4, 2)}
    # the nested classes (query heads and QK maps within K/V heads) converge slowly under
    # coordinate descent: 1.6e-3 after the default 6 sweeps, 6e-9 after 20
    assert recovered(m, r, (x,), max_iter=30) < 1e-8


class DbrxStyle(FusedGQA):
    """A DBRX block: the fused-Wqkv GQA attention above, then a top-k routed GLU mixture of
    experts whose weights are stored flat, ``[E·I, d]`` as DBRX stores them, viewed per expert
    and gathered by the router's labels."""

    def __init__(self, d=16, E=4, k=2, I=6):
        super().__init__(d)
        self.E, self.k, self.I = E, k, I
        self.router = nn.Linear(d, E, bias=False)
        self.w1, self.v1, self.w2 = (nn.Parameter(torch.randn(E * I, d) / 4) for _ in range(3))

    def forward(self, x):
        h = self.attend(self.emb(x))
        flat = h.reshape(-1, h.shape[-1])
        top = torch.topk(torch.softmax(self.router(flat), -1), self.k, dim=-1)
        idx = top.indices.reshape(-1)
        xs = flat.repeat_interleave(self.k, 0).unsqueeze(-1)
        w1, v1, w2 = (w.view(self.E, self.I, -1)[idx] for w in (self.w1, self.v1, self.w2))
        g = F.silu(torch.bmm(w1, xs)) * torch.bmm(v1, xs)
        y = torch.bmm(w2.transpose(1, 2), g).squeeze(-1) * top.values.reshape(-1, 1)
        return self.head(h + y.reshape(-1, self.k, h.shape[-1]).sum(1).reshape(h.shape))


def test_dbrx_block_fused_gqa_and_experts():
    torch.manual_seed(0)
    m, x = DbrxStyle().eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < CERT
    (experts,) = r.group_of("router.weight", 0)
    assert (experts.kind, experts.size) == ("perm", 4)
    # the flat [E·I, d] weights: experts × hidden on one axis, each expert its own order
    for w in ("w1", "v1", "w2"):
        assert r.axis_structure(r.param_axes(w)[0]) == ("prod", [4, 6])
    (hidden,) = [g for g in r.group_of("w2", 0) if g != experts]
    assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", 6, 4, [experts.id])
    assert {("gl", 4, 2), ("perm", 2, 1), ("perm", 2, 2)} <= set(kinds(r))  # attention as above
    assert recovered(m, r, (x,), max_iter=30) < 1e-8
    # the same size bound as for stacked weights: past it, one order for all experts
    from symgraph.passes.patterns import stacked
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stacked, "MAX_STACKED", (4 * 6) ** 2 - 1)
        r = symgraph.analyze(m, (x,))
    (hidden,) = [g for g in r.group_of("w2", 0) if g != experts]
    assert (hidden.blocks, hidden.outer) == (1, []) and hidden.id in r.shared
    assert r.certify(m, (x,)) < CERT


class MHA(nn.Module):
    """``nn.MultiheadAttention`` (packed ``in_proj``: one [3E, E] weight, taken apart by
    unflatten + select) in a custom module with a residual and a head."""

    def __init__(self, d=16, h=4):
        super().__init__()
        self.emb, self.head = nn.Linear(5, d), nn.Linear(d, 3)
        self.att = nn.MultiheadAttention(d, h, batch_first=True)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.att(h, h, h, need_weights=False)
        return self.head(h + a)


def test_multihead_attention_packed_in_proj():
    torch.manual_seed(0)
    m, x = MHA().eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < CERT
    # the packed axis is Q ⊕ K ⊕ V, each split into heads: QK and VO maps per head, as for
    # separate projections (it was one orthogonal map shared by Q, K, V and O)
    packed = r.param_axes("att.in_proj_weight")[0]
    assert r.axis_structure(packed) == ("sum", [16, 16, 16])
    assert kinds(r, "att") == [("gl", 4, 4), ("gl", 4, 4), ("perm", 4, 1)]
    (vo,) = [g for g in r.groups if ("att.out_proj.weight", 1) in g.params and g.kind == "gl"]
    (qk,) = [g for g in r.groups if g.kind == "gl" and g.blocks == 4 and g != vo]
    assert ("att.out_proj.weight", 1) not in qk.params
    # slow coordinate descent between the free residual map and the per-head maps:
    # 6e-4 after the default 6 sweeps, 2e-9 after 20
    assert recovered(m, r, (x,), max_iter=30) < 1e-8


def test_mamba2_mixer_channels():
    cfg = mamba2_config()
    m, x = randomized(transformers.Mamba2ForCausalLM(cfg)), {"input_ids": ids()}
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < 1e-6  # the scan runs partly in float32
    mix = "backbone.layers.0.mixer"
    # SSM heads (A, D, dt bias move with them), the state channels of B and C, and the
    # channels inside each head (through the depthwise conv1d, the gated norm, out_proj).
    # The scan's zero initial state fixes nothing (it used to fix all three).
    heads = only(r, f"{mix}.A_log", 0)
    assert (heads.kind, heads.size) == ("perm", 4)
    assert {(f"{mix}.D", 0), (f"{mix}.dt_bias", 0)} <= set(heads.params)
    inner = [g for g in r.group_of(f"{mix}.out_proj.weight", 1) if g != heads]
    assert [(g.kind, g.dim, g.blocks, g.outer) for g in inner] == [("perm", 8, 4, [heads.id])]
    assert (f"{mix}.norm.weight", 0) in inner[0].params
    state = [g for g in r.groups if g.kind == "perm" and g.size == 8 and g.blocks == 1]
    assert len(state) == 1 and (f"{mix}.conv1d.weight", 0) in state[0].params
    assert only(r, "backbone.embeddings.weight", 1).kind == "orthogonal"
    assert recovered(m, r, x) < 1e-9

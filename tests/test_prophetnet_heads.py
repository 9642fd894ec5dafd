"""Issue 65, ProphetNet's decoder: its n-gram self-attention's heads cannot be permuted, while
each head's own maps (an invertible map of its query/key width, another of its value width)
can vary per head. The predict stream adds relative-position biases gathered from rows of the
embeddings ordered (batch, position, stream, head), by bucket indices whose rows are ordered
(stream, batch, head, position), and reads the result as (batch, stream, head, position)
(``get_predict_relative_pos_embeddings``): a head's bias comes from other heads' columns, so
permuting the heads (queries, keys, values, output and the bias columns alike) changes the
predict stream; the main stream, whose orders agree, is unchanged. The bias does not read the
queries or keys, so per-head maps keep both streams. The analysis must claim no permutation of
the decoder's heads; it certifies."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs

T = pytest.importorskip("transformers")
HEADS, HEAD_DIM, BUCKETS = 4, 8, 8


def _model():
    cfg = T.ProphetNetConfig(vocab_size=64, hidden_size=HEADS * HEAD_DIM, encoder_ffn_dim=48, decoder_ffn_dim=48,
                             num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=HEADS,
                             num_decoder_attention_heads=HEADS, max_position_embeddings=32, ngram=2,
                             num_buckets=BUCKETS, relative_max_distance=16)
    torch.manual_seed(0)
    return T.ProphetNetForConditionalGeneration(cfg).eval()  # float32: in float64 its masks make NaNs


def _heads_permuted(attn, sigma) -> None:
    rows = torch.cat([torch.arange(HEAD_DIM) + HEAD_DIM * int(h) for h in sigma])
    bias = torch.tensor([b * HEADS + int(h) for b in range(BUCKETS) for h in sigma])  # (bucket, head) columns
    with torch.no_grad():
        for lin in (attn.query_proj, attn.key_proj, attn.value_proj):
            lin.weight.copy_(lin.weight[rows])
            lin.bias.copy_(lin.bias[rows])
        attn.out_proj.weight.copy_(attn.out_proj.weight[:, rows])
        attn.relative_pos_embeddings.weight.copy_(attn.relative_pos_embeddings.weight[bias])
        attn.relative_pos_embeddings.bias.copy_(attn.relative_pos_embeddings.bias[bias])


def _per_head_maps(attn, seed: int = 1) -> None:
    """Queries by ``Aᵀ``, keys by ``A⁻¹``, values by ``Bᵀ``, the output's columns by ``B⁻ᵀ``;
    ``A`` and ``B`` block-diagonal, one invertible block per head."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.block_diag(*[torch.randn(HEAD_DIM, HEAD_DIM, generator=g) + 3 * torch.eye(HEAD_DIM)
                               for _ in range(HEADS)]) for _ in range(2))
    with torch.no_grad():
        for lin, m in ((attn.query_proj, a.T), (attn.key_proj, torch.linalg.inv(a)), (attn.value_proj, b.T)):
            lin.weight.copy_(m @ lin.weight)
            lin.bias.copy_(m @ lin.bias)
        attn.out_proj.weight.copy_(attn.out_proj.weight @ torch.linalg.inv(b.T))


def _attention_outputs(m, kw):
    got = []
    attn = m.prophetnet.decoder.layers[0].self_attn
    handle = attn.register_forward_hook(lambda mod, args, out: got.append(out[0]))
    with torch.no_grad():
        m(**kw)
    handle.remove()
    return got[0]


def test_decoder_heads_do_not_permute_but_their_maps_vary_per_head():
    m = _model()
    _, kw = default_inputs(m)
    seq = kw["decoder_input_ids"].shape[1]
    before = _attention_outputs(m, kw)
    permuted, mapped = copy.deepcopy(m), copy.deepcopy(m)
    _heads_permuted(permuted.prophetnet.decoder.layers[0].self_attn, [2, 0, 3, 1])
    _per_head_maps(mapped.prophetnet.decoder.layers[0].self_attn)
    after, kept = _attention_outputs(permuted, kw), _attention_outputs(mapped, kw)
    assert (after[:, :seq] - before[:, :seq]).abs().max() < 1e-6  # main stream: orders agree
    assert (after[:, seq:] - before[:, seq:]).abs().max() > 1e-2 * before.abs().max()  # predict: no symmetry
    assert (kept - before).abs().max() < 1e-5 * max(1.0, float(before.abs().max()))  # per-head maps: one


def test_analysis_claims_no_permutation_of_the_decoder_heads_and_certifies():
    m = _model()
    r = symgraph.analyze(m)
    q = "prophetnet.{}.layers.0.self_attn.query_proj.weight"
    assert ("perm", HEADS) not in [(g.kind, g.size) for g in r.group_of(q.format("decoder"), 0)]
    assert ("perm", HEADS) in [(g.kind, g.size) for g in r.group_of(q.format("encoder"), 0)]
    bias = r.axis_reasons("prophetnet.decoder.layers.0.self_attn.relative_pos_embeddings.weight", 0)
    assert bias[0]["kind"] == "identity" and any("index values" in why for _, why in bias[0]["reasons"])
    assert r.certify(m) <= 1e-6

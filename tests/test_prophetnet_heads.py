"""Issue 65, ProphetNet's decoder: its n-gram self-attention has no per-head class, and rightly.
The predict stream gathers relative-position biases from rows of the embeddings ordered
(batch, position, stream, head) with bucket indices whose rows are ordered (stream, batch,
head, position) (``get_predict_relative_pos_embeddings``: the embeddings are permuted one way,
the buckets repeated another), so a head's bias is read from another head's columns: permuting
the decoder's heads (queries, keys, values, output and the bias columns alike) changes the
predict stream while the main stream, whose orders agree, is unchanged. The analysis keeps the
decoder's heads fixed, gives the encoder's heads their class, and certifies."""
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
    return T.ProphetNetForConditionalGeneration(cfg).eval()


def _heads_permuted(attn, sigma) -> None:
    rows = torch.cat([torch.arange(HEAD_DIM) + HEAD_DIM * int(h) for h in sigma])
    bias = torch.tensor([b * HEADS + int(h) for b in range(BUCKETS) for h in sigma])  # (bucket, head) columns
    with torch.no_grad():
        for lin in (attn.query_proj, attn.key_proj, attn.value_proj):
            lin.weight.copy_(lin.weight[rows])
            lin.bias.copy_(lin.bias[rows])
        attn.out_proj.weight.copy_(attn.out_proj.weight[:, rows])
        if hasattr(attn, "relative_pos_embeddings"):
            attn.relative_pos_embeddings.weight.copy_(attn.relative_pos_embeddings.weight[bias])
            attn.relative_pos_embeddings.bias.copy_(attn.relative_pos_embeddings.bias[bias])


def _attention_outputs(m, attn, kw):
    got = []
    handle = attn.register_forward_hook(lambda mod, args, out: got.append(out[0]))
    with torch.no_grad():
        m(**kw)
    handle.remove()
    return got[0]


def test_permuting_decoder_heads_changes_the_predict_stream_only():
    m = _model()
    _, kw = default_inputs(m)
    seq = kw["decoder_input_ids"].shape[1]
    before = _attention_outputs(m, m.prophetnet.decoder.layers[0].self_attn, kw)
    moved = copy.deepcopy(m)
    _heads_permuted(moved.prophetnet.decoder.layers[0].self_attn, [2, 0, 3, 1])
    after = _attention_outputs(moved, moved.prophetnet.decoder.layers[0].self_attn, kw)
    assert (after[:, :seq] - before[:, :seq]).abs().max() < 1e-6  # main stream: orders agree
    assert (after[:, seq:] - before[:, seq:]).abs().max() > 1e-2 * before.abs().max()  # predict: not a symmetry


def test_analysis_fixes_the_decoder_heads_and_frees_the_encoders():
    m = _model()
    r = symgraph.analyze(m)
    q = "prophetnet.{}.layers.0.self_attn.query_proj.weight"
    assert [(g.kind, g.size) for g in r.group_of(q.format("decoder"), 0)] == [("gl", HEAD_DIM)]  # no head perm
    assert ("perm", HEADS) in [(g.kind, g.size) for g in r.group_of(q.format("encoder"), 0)]
    bias = r.axis_reasons("prophetnet.decoder.layers.0.self_attn.relative_pos_embeddings.weight", 0)
    assert bias[0]["kind"] == "identity" and any("index values" in why for _, why in bias[0]["reasons"])
    assert r.certify(m) <= 1e-6

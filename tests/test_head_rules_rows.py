"""Issue 65, attention rows with no per-head class.

XLNet (causal LM, sequence classification) reads its segment embedding and bias only on
``token_type_ids`` and its mask embedding only on the query stream (``target_mapping``), so its
example inputs carry both (the query stream as its own ``prepare_inputs_for_generation`` builds
it): every parameter is read, the MLP and the head permutation are claimed and certify, and a
transformed copy is recovered by weights.

ProphetNet's decoder self-attention is *not* head-symmetric as transformers computes it: the
predicting streams read the relative-position bias rows laid out ``(batch, position, ngram,
head)`` as ``(ngram, batch, head, position)``, so a head's bias comes from other heads and
positions. A head swap (queries, keys, values, output columns and the bias's head columns
together) keeps the main stream and changes the first predicting stream, ``logits``: the
analysis must claim no permutation of those heads (and does). Each head's own maps may still
vary per head (the bias reads no query or key): tests/test_prophetnet_heads.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs

transformers = pytest.importorskip("transformers")
T = transformers


def _rel_params(a, b):
    num = sum(float((p.double() - q.double()).pow(2).sum()) for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum(float(p.double().pow(2).sum()) for p in a.parameters())) ** 0.5


def _xlnet(cls=None):
    torch.manual_seed(0)
    cfg = T.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_head=8, d_inner=48, dropout=0.0,
                        num_labels=3)
    return (cls or T.XLNetLMHeadModel)(cfg).eval()


@pytest.fixture(scope="module")
def xlnet():
    m = _xlnet()
    return m, symgraph.analyze(m)


def test_xlnet_inputs_carry_segments_and_the_query_stream():
    _, kw = default_inputs(_xlnet())
    b, s = kw["input_ids"].shape
    assert kw["token_type_ids"].tolist() == [[0] * (s // 2) + [1] * (s - s // 2)] * b
    target = torch.zeros(b, 1, s)
    target[:, 0, -1] = 1
    assert torch.equal(kw["target_mapping"], target)
    assert kw["perm_mask"][:, :, -1].eq(1).all() and kw["perm_mask"][:, :, :-1].eq(0).all()


@pytest.mark.slow
def test_xlnet_claims_mlp_and_heads_and_certifies(xlnet):
    m, rep = xlnet
    heads = [g for g in rep.groups if g.kind == "perm" and g.dim == 4
             and ("transformer.layer.0.rel_attn.q", 1) in g.params]
    assert len(heads) == 1
    assert {("transformer.layer.0.rel_attn.k", 1), ("transformer.layer.0.rel_attn.v", 1),
            ("transformer.layer.0.rel_attn.o", 1), ("transformer.layer.0.rel_attn.r_w_bias", 0),
            ("transformer.layer.0.rel_attn.seg_embed", 1)} <= set(heads[0].params)
    mlp = [g for g in rep.groups if ("transformer.layer.1.ff.layer_1.weight", 0) in g.params]
    assert [g.kind for g in mlp] == ["perm"] and ("transformer.layer.1.ff.layer_2.weight", 1) in mlp[0].params
    claimed = {p for g in rep.groups for p, _ in g.params}
    assert {"transformer.layer.0.rel_attn.r_s_bias", "transformer.layer.1.rel_attn.seg_embed"} <= claimed
    assert rep.certify(m) <= 1e-6


@pytest.mark.slow
def test_xlnet_recovered_by_weights(xlnet):
    a, rep = xlnet
    b = symgraph.transform(a, rep.random_transform(seed=1, orthogonal=True))
    assert _rel_params(a, b) > 0.1
    c = symgraph.align(a, b).apply(b)
    assert _rel_params(a, c) < 1e-6


@pytest.mark.slow
def test_xlnet_classifier_reads_every_parameter():
    m = _xlnet(T.XLNetForSequenceClassification)
    rep = symgraph.analyze(m)
    assert any(g.kind == "perm" and ("transformer.layer.0.ff.layer_1.weight", 0) in g.params for g in rep.groups)
    assert rep.certify(m) <= 1e-6


def _prophetnet():
    torch.manual_seed(0)
    cfg = T.ProphetNetConfig(vocab_size=64, hidden_size=32, encoder_ffn_dim=48, decoder_ffn_dim=48,
                             num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
                             num_decoder_attention_heads=4, ngram=2, num_buckets=8, relative_max_distance=16,
                             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0)
    return T.ProphetNetForConditionalGeneration(cfg).eval()


def _head_swap(m):
    """Heads 0 and 1 of the decoder's self-attention swapped everywhere they are read."""
    c = copy.deepcopy(m)
    a = c.prophetnet.decoder.layers[0].self_attn
    h, d = a.num_attn_heads, a.head_dim
    pi = torch.tensor([1, 0] + list(range(2, h)))
    rows = (pi[:, None] * d + torch.arange(d)).reshape(-1)
    cols = (torch.arange(a.num_buckets)[:, None] * h + pi[None, :]).reshape(-1)
    with torch.no_grad():
        for p in (a.query_proj, a.key_proj, a.value_proj):
            p.weight.copy_(p.weight[rows])
            p.bias.copy_(p.bias[rows])
        a.out_proj.weight.copy_(a.out_proj.weight[:, rows])
        r = a.relative_pos_embeddings
        r.weight.copy_(r.weight[cols])
        r.bias.copy_(r.bias[cols])
    return c


def test_prophetnet_predicting_stream_is_not_head_symmetric():
    m = _prophetnet()  # float32: its masks take float32's lowest value, NaN in float64
    _, kw = default_inputs(m)
    swapped = _head_swap(m)
    with torch.no_grad():
        ref, out = m(**kw), swapped(**kw)
        main = [x.prophetnet(**kw).last_hidden_state for x in (m, swapped)]
    kept = float((main[0] - main[1]).abs().max())
    moved = float((ref.logits - out.logits).abs().max() / ref.logits.abs().max())
    assert kept < 1e-5  # the main stream: a symmetry (float32 round-off)
    assert moved > 1e-4 and moved > 100 * kept  # the first predicting stream: none


def test_prophetnet_decoder_self_attention_claims_no_head_permutation():
    m = _prophetnet()
    rep = symgraph.analyze(m)
    q = "prophetnet.decoder.layers.0.self_attn.query_proj.weight"
    assert all(leaf["kind"] == "identity" or leaf["size"] != 4 for leaf in rep.axis_reasons(q, 0))
    assert not any(g.kind == "perm" and g.size == 4 and (q, 0) in g.params for g in rep.groups)
    assert rep.certify(m) <= 1e-6

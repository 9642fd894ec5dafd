"""Issue 65, ProphetNet's decoder (seq2seq_lm row: "no per-head class"): each head's own maps
(an invertible map of its query/key width, another of its value width) vary per head, though
the heads themselves cannot be permuted (tests/test_head_rules_rows.py: the predict stream's
relative-position bias rows are scrambled across heads). The bias reads no query or key, so
per-head maps keep both streams. The gather's bucket index is a constant of the program (built
from ``arange``): every axis of it is fixed, and no rule reads it. What kept the per-head class
was the example decoder length: at 4 positions, the heads' count, the view that reads the
gathered bias rows in another order made the decoder's positions and heads one class, which
every attention sums over; at an odd length (5) it does not, and the class is claimed,
certified and recovered."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

T = pytest.importorskip("transformers")
HEADS, HEAD_DIM, BUCKETS = 4, 8, 8


def _model():
    cfg = T.ProphetNetConfig(vocab_size=64, hidden_size=HEADS * HEAD_DIM, encoder_ffn_dim=48, decoder_ffn_dim=48,
                             num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=HEADS,
                             num_decoder_attention_heads=HEADS, max_position_embeddings=32, ngram=2,
                             num_buckets=BUCKETS, relative_max_distance=16)
    torch.manual_seed(0)
    return T.ProphetNetForConditionalGeneration(cfg).eval()  # float32: in float64 its masks make NaNs


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


def test_decoder_maps_vary_per_head_and_keep_both_streams():
    m = _model()
    _, kw = default_inputs(m)
    before = _attention_outputs(m, kw)
    mapped = copy.deepcopy(m)
    _per_head_maps(mapped.prophetnet.decoder.layers[0].self_attn)
    kept = _attention_outputs(mapped, kw)
    assert (kept - before).abs().max() < 1e-5 * max(1.0, float(before.abs().max()))


@pytest.mark.slow
def test_analysis_claims_per_head_maps_certifies_and_recovers():
    m = _model()
    _, kw = default_inputs(m)
    assert kw["decoder_input_ids"].shape == (2, 5)  # odd: the size of no head, batch or stream axis
    r = symgraph.analyze(m)
    q = "prophetnet.decoder.layers.0.self_attn.query_proj.weight"
    heads, width = r.axis_reasons(q, 0)
    assert (heads["size"], heads["kind"]) == (HEADS, "identity")  # heads fixed: not a symmetry
    assert (width["size"], width["kind"], width["fibre"]) == (HEAD_DIM, "gl", [HEADS])  # varies per head
    assert ("perm", HEADS) in [(g.kind, g.size) for g in r.group_of(q.replace("decoder", "encoder"), 0)]
    assert r.certify(m) <= 1e-6
    m = randomized(_model())  # float64, every weight drawn: recovered by weights
    r = symgraph.analyze(m)
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    back = symgraph.align(m, moved).apply(moved).state_dict()
    want, was = m.state_dict(), moved.state_dict()
    assert (was[q] - want[q]).abs().max() > 0.1  # the decoder's per-head maps moved its queries
    assert max((back[k] - want[k]).abs().max().item() for k in want) < 1e-9

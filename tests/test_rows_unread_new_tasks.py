"""Issue 65, new-task coverage rows that were sound but claimed little: a Q-Former's learned
queries attend over a batch of audio windows (Granite Speech: one row of queries broadcast over
the keys' rows, which the attention rule paired as one axis and froze), and a speech LM whose
default config names no audio token (Voxtral: the shrink rule gives it a free id, as a real
checkpoint states one). Each on a tiny model, no inputs needed where the model is Hugging Face's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import symgraph

T = pytest.importorskip("transformers")


class LearnedQueries(torch.nn.Module):
    """Three learned queries (one row) attend over each row of ``x``: 4 heads of 4."""

    def __init__(self, d=16, heads=4, queries=3):
        super().__init__()
        self.heads = heads
        self.query = torch.nn.Parameter(torch.randn(1, queries, d))
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def split(self, t):
        return t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(self.query)), self.split(self.k(x)), self.split(self.v(x))
        a = F.scaled_dot_product_attention(q, k, v)  # (1, H, 3, d) against (B, H, n, d): (B, H, 3, d)
        return self.o(a.transpose(1, 2).reshape(x.shape[0], q.shape[2], -1))


def _group_of(rep, slot):
    """The head-structured class (an element per head) holding ``slot``."""
    return next((g for g in rep.groups if g.blocks > 1 and slot in [tuple(p) for p in g.params]), None)


def test_a_query_of_one_row_broadcast_over_the_keys_batch_keeps_its_heads():
    """The query's batch axis (1) is broadcast against the keys' (5): the rule pairs only axes of
    one size, so the heads of q and k are one class (their contraction dual), v's and o's
    another, nothing frozen by the attention, and a random element leaves the output as it is."""
    torch.manual_seed(0)
    m = LearnedQueries().eval()
    x = torch.randn(5, 7, 16)
    rep = symgraph.analyze(m, (x,))
    assert not [f for f in rep.frozen if "scaled_dot_product" in str(f.op)]
    qk, vo = _group_of(rep, ("q.weight", 0)), _group_of(rep, ("v.weight", 0))
    assert qk is not None and qk.kind != "identity" and ("k.weight", 0) in [tuple(p) for p in qk.params]
    assert vo is not None and vo.kind != "identity" and ("o.weight", 1) in [tuple(p) for p in vo.params]
    assert qk.blocks == 4 and vo.blocks == 4  # an element per head
    assert rep.certify(m, (x,)) <= 1e-6


def _granite_speech():
    enc = T.GraniteSpeechEncoderConfig(input_dim=8, num_layers=2, hidden_dim=32, feedforward_mult=2, num_heads=2,
                                       dim_head=16, output_dim=8, context_size=16, max_pos_emb=64,
                                       conv_kernel_size=3)
    proj = T.Blip2QFormerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                                encoder_hidden_size=32, cross_attention_frequency=1)
    text = T.GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    cfg = T.GraniteSpeechConfig(encoder_config=enc, projector_config=proj, text_config=text, audio_token_id=63,
                                window_size=4, downsample_rate=2)
    torch.manual_seed(0)
    return T.GraniteSpeechForConditionalGeneration(cfg).eval()


def test_granite_speech_claims_its_q_former_cross_attention_heads():
    """Granite Speech's projector: a Q-Former whose learned queries (one row) cross-attend to
    each window of the audio encoder's states (a batch of windows). ``analyze`` with no inputs
    reads every parameter and claims the cross-attention's query and key projections as one
    head-structured class, and its value and output projections as another; certified."""
    m = _granite_speech()  # two encoder layers: the middle one's CTC self-conditioning is read
    rep = symgraph.analyze(m)
    assert rep.unread is None
    assert not [f for f in rep.frozen if "scaled_dot_product" in str(f.op)]
    cross = "model.projector.qformer.encoder.layer.0.crossattention."
    qk = _group_of(rep, (cross + "attention.query.weight", 0))
    vo = _group_of(rep, (cross + "attention.value.weight", 0))
    assert qk is not None and qk.blocks == 2 and (cross + "attention.key.weight", 0) in [tuple(p) for p in qk.params]
    assert vo is not None and vo.blocks == 2 and (cross + "output.dense.weight", 1) in [tuple(p) for p in vo.params]
    assert rep.certify(m) <= 1e-6


def test_an_audio_token_left_none_beside_an_audio_config_gets_a_free_id():
    """The shrink rule's placeholder tokens (:func:`benchmarks.coverage.derived.placeholder_tokens`)
    cover audio: transformers' default Voxtral config names no audio token (its forward then never
    reads the audio tower); the shrunk one takes the highest id no other token takes; a level with
    no audio config, or one that states its token, is left alone; image tokens as before."""
    from benchmarks.coverage.shrink import tiny_config
    from benchmarks.coverage.derived import placeholder_tokens
    fields = vars(T.VoxtralConfig())
    assert fields["audio_token_id"] is None
    assert placeholder_tokens(fields, {}, 256) == {"audio_token_id": 255}
    assert placeholder_tokens(fields, {"pad_token_id": 255}, 256) == {"audio_token_id": 254}
    assert placeholder_tokens({**fields, "audio_token_id": 24}, {}, 256) == {}
    assert placeholder_tokens({"audio_token_id": None, "audio_config": None}, {}, 256) == {}
    assert placeholder_tokens({"image_token_id": None, "vision_config": object()}, {}, 256) == {"image_token_id": 255}
    cfg, overrides = tiny_config("voxtral")
    assert cfg.audio_token_id == overrides["audio_token_id"] == 255 < cfg.text_config.vocab_size


def _voxtral(token):
    audio = T.VoxtralEncoderConfig(vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_mel_bins=16, max_source_positions=16)
    text = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return T.VoxtralForConditionalGeneration(T.VoxtralConfig(audio_config=audio, text_config=text,
                                                             audio_token_id=token)).eval()


def test_voxtral_with_an_audio_token_reads_and_claims_its_audio_tower():
    """With an audio token (the id the rule gives) the example inputs hold log-mel features (16
    bins, 32 frames) and as many audio tokens as its projector gives embeddings; ``analyze`` with
    no inputs reads every parameter, claims every matrix of the audio tower and projector, and
    certifies. Without one (transformers' default) the tower is unread and nothing is claimed."""
    from symgraph.passes.inputs import default_inputs
    m = _voxtral(63)
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 16, 32) and int((kw["input_ids"] == 63).sum()) == 2 * 4
    rep = symgraph.analyze(m)
    assert rep.unread is None
    claimed = {p for g in rep.groups if g.kind != "identity" for p, _ in g.params}
    tower = {n for n, p in m.named_parameters() if p.dim() > 1 and n.startswith(("model.audio_tower.layers.",
                                                                                "model.multi_modal_projector."))}
    assert tower and tower <= claimed, sorted(tower - claimed)[:4]
    assert rep.certify(m) <= 1e-6
    bare = symgraph.analyze(_voxtral(None))
    assert bare.unread is not None and "audio_tower" in bare.unread and not bare.groups

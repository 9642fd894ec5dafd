"""Issue 65, coverage rows of speech and detection that failed in the eager run: each failure
was our example inputs, fixed where the mechanism is. One tiny model per mechanism; each runs
eagerly on ``default_inputs(model)`` and ``symgraph.analyze(model)`` with no inputs claims the
tower the fix makes it read, and certifies."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs

T = pytest.importorskip("transformers")


def _claimed(rep, prefix) -> set:
    return {p for g in rep.groups if g.kind != "identity" for p, _ in g.params if p.startswith(prefix)}


def _weights(m, prefix) -> set:
    return {n for n, p in m.named_parameters() if n.startswith(prefix) and p.requires_grad
            and n.endswith("weight") and p.dim() > 1}


def _certified_and_claims(m, prefixes, tol: float = 1e-6):
    rep = symgraph.analyze(m)
    assert rep.unread is None  # every parameter read: nothing fixed for want of inputs
    for prefix in prefixes:
        weights = _weights(m, prefix)
        assert weights and weights <= _claimed(rep, prefix), sorted(weights - _claimed(rep, prefix))[:4]
    assert rep.certify(m) <= tol
    return rep


def _voxtral_realtime():
    audio = T.VoxtralRealtimeEncoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                           num_mel_bins=16)
    text = T.VoxtralRealtimeTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       max_position_embeddings=256)
    torch.manual_seed(0)
    return T.VoxtralRealtimeForConditionalGeneration(
        T.VoxtralRealtimeConfig(audio_config=audio, text_config=text)).eval()


def test_voxtral_realtime_adds_audio_to_as_many_tokens_as_its_embeddings():
    """Voxtral Realtime has no audio token: its forward refuses text alone and adds each audio
    embedding to one token's. The inputs are log-mel features of its audio config (16 bins, 64
    frames, channels first: the frames-first layout does not run) and as many token ids as its
    own ``get_audio_features`` gives embeddings per row (64 frames, halved by its convolution,
    4 frames an embedding: 8)."""
    m = _voxtral_realtime()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 16, 64)
    with torch.no_grad():
        emb = m.get_audio_features(input_features=kw["input_features"]).pooler_output
    assert emb.shape[:2] == (2, 8) and kw["input_ids"].shape == (2, 8)
    assert int(kw["input_ids"].max()) < 64
    with torch.no_grad():
        assert m(**kw).logits.shape == (2, 8, 64)
    _certified_and_claims(m, ["model.audio_tower.layers.", "model.multi_modal_projector."])

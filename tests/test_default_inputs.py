"""Example inputs from a model's own config and signature (issue 65): ``symgraph.analyze(model)``
with no inputs on one tiny model of each task: seq2seq LM (T5, BART), sequence classification of
an encoder-decoder (BART, T5: an end-of-sequence token per row), speech CTC (Wav2Vec2),
speech-to-text (Whisper), two towers (CLIP), a vision-language model whose vocabulary sits in
its text config (Gemma 3); each certified in float64. T5's cross-attention: its heads and per-head classes
found, certified, and a transformed copy recovered by weights."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.testing.models import randomized
from symgraph.passes.inputs import default_inputs

transformers = pytest.importorskip("transformers")
T = transformers

BART = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=20, max_position_embeddings=32)
T5 = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=4)


MODELS = {
    "t5_seq2seq": lambda: T.AutoModelForSeq2SeqLM.from_config(T.T5Config(**T5)),
    "bart_seq2seq": lambda: T.AutoModelForSeq2SeqLM.from_config(T.BartConfig(**BART)),
    "bart_sequence_classification": lambda: T.BartForSequenceClassification(T.BartConfig(**BART, num_labels=3)),
    "t5_sequence_classification": lambda: T.T5ForSequenceClassification(T.T5Config(**T5, num_labels=3)),
    "wav2vec2_ctc": lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2)),
    "ast_audio_classification": lambda: T.ASTForAudioClassification(T.ASTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24, patch_size=4,
        frequency_stride=4, time_stride=4, max_length=16, num_mel_bins=16, num_labels=3)),
    "whisper": lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, num_mel_bins=8,
        max_source_positions=8, max_target_positions=16, pad_token_id=1, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=2)),
    "clip": lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4), projection_dim=8)),
    "gemma3_text_config": lambda: T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=60, boi_token_index=61, eoi_token_index=62)),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_analyze_needs_no_inputs(name):
    m = randomized(MODELS[name]())
    r = symgraph.analyze(m)
    assert r.frozen == [] and r.groups and r.certify(m) < 1e-6


def test_inputs_follow_the_config():
    _, kw = default_inputs(randomized(MODELS["gemma3_text_config"]()))  # 4 image tokens a row
    ids = kw["input_ids"]
    assert set(kw) == {"input_ids", "pixel_values", "use_cache"} and kw["pixel_values"].shape == (2, 3, 16, 16)
    assert 0 <= int(ids.min()) and int(ids.max()) < 64 and (ids == 60).sum(1).tolist() == [4, 4]
    assert not ((ids == 61) | (ids == 62)).any()  # no other special token
    _, kw = default_inputs(randomized(MODELS["clip"]()))  # two towers: ids and images at 16
    assert kw["input_ids"].shape == (2, 8) and kw["pixel_values"].shape == (2, 3, 16, 16)
    assert kw["pixel_values"].dtype == torch.float64  # the model's dtype
    w2v = randomized(MODELS["wav2vec2_ctc"]())
    _, kw = default_inputs(w2v)
    assert kw["input_values"].dim() == 2
    with torch.no_grad():  # the feature extractor leaves 8 frames
            assert w2v.wav2vec2.feature_extractor(kw["input_values"]).shape[-1] == 8
    _, kw = default_inputs(randomized(MODELS["ast_audio_classification"]()))  # a spectrogram
    assert kw["input_values"].shape == (2, 16, 16)
    _, kw = default_inputs(randomized(MODELS["whisper"]()))
    assert kw["input_features"].shape == (2, 8, 16) and kw["decoder_input_ids"][:, 0].tolist() == [2, 2]
    cfg = T.BartConfig(**BART, num_labels=3, eos_token_id=2, pad_token_id=1)
    _, kw = default_inputs(T.BartForSequenceClassification(cfg))
    ids, dec = kw["input_ids"], kw["decoder_input_ids"]
    assert ids[:, -1].tolist() == [2, 2] and (ids == 2).sum(1).tolist() == [1, 1] and not (ids == 1).any()
    assert torch.equal(dec[:, 1:], ids[:, :-1]) and dec[:, 0].tolist() == [cfg.decoder_start_token_id] * 2
    with pytest.raises(symgraph.InputError, match="not a Hugging Face model"):
        default_inputs(torch.nn.Linear(2, 2))


def test_t5_cross_attention_heads_certified_and_recovered():
    m = randomized(MODELS["t5_seq2seq"]())
    r = symgraph.analyze(m, outputs=["logits"])
    assert r.frozen == [] and r.certify(m) < 1e-9
    cross = "decoder.block.0.layer.1.EncDecAttention"
    q = r.group_of(f"{cross}.q.weight", 0)
    assert q == r.group_of(f"{cross}.k.weight", 0)  # decoder queries, encoder keys
    # T5 adds a bias of zeros plus the mask, the same for every head, to the scores: the heads
    # are a permutation class of their own, QK and VO per head fibred over it
    (heads,) = [g for g in q if g.kind == "perm"]
    (qk,) = [g for g in q if g.kind != "perm"]
    (vo,) = [g for g in r.group_of(f"{cross}.v.weight", 0) if g.kind != "perm"]
    assert heads.size == 4 and (qk.kind, qk.dim, qk.blocks, vo.kind, vo.dim, vo.blocks) == ("gl", 4, 4, "gl", 4, 4)
    assert r.fibre_groups(qk.id) == r.fibre_groups(vo.id) == (heads.id,) and vo != qk
    assert heads in r.group_of(f"{cross}.o.weight", 1) and (f"{cross}.o.weight", 1) in vo.params
    self_heads = [g for g in r.group_of("decoder.block.0.layer.0.SelfAttention.q.weight", 0) if g.kind == "perm"]
    assert self_heads and heads not in self_heads
    # one stream: the encoder's, read by the cross-attention's keys and values, is the decoder's
    # too (the embedding is shared)
    (stream,) = r.group_of("encoder.block.0.layer.1.DenseReluDense.wo.weight", 0)
    assert {(f"{cross}.k.weight", 1), (f"{cross}.v.weight", 1), (f"{cross}.o.weight", 0)} <= set(stream.params)
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved, outputs=["logits"])
    got, want, was = al.apply(moved).state_dict(), m.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-9


def test_head_models_keep_their_head_outputs_by_default():
    m = randomized(MODELS["t5_seq2seq"]())
    r = symgraph.analyze(m)  # logits, not the encoder's last hidden state
    assert r.outputs == ("logits",) and r.group_of("shared.weight", 1) != []
    full = symgraph.analyze(m, outputs="all")  # opt in: hidden states kept fix the stream
    assert full.outputs is None and full.group_of("shared.weight", 1) == [] and full.certify(m) < 1e-9
    clip = randomized(MODELS["clip"]())
    assert symgraph.analyze(clip).outputs == ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")
    # a model without a head: every output
    bert = randomized(T.BertModel(T.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=4, intermediate_size=24,
                                               max_position_embeddings=16)))
    assert symgraph.analyze(bert).outputs is None


def test_bart_sequence_classification_reads_the_eos_token():
    """The head picks each row's hidden state at its end-of-sequence token (a boolean mask: a
    size that depends on the data, taken from the example inputs): the stream stays free."""
    m = randomized(MODELS["bart_sequence_classification"]())
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.frozen == [] and r.certify(m) < 1e-9
    (stream,) = r.group_of("model.shared.weight", 1)
    assert ("classification_head.dense.weight", 1) in stream.params
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved)
    got, want, was = al.apply(moved).state_dict(), m.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-9


@pytest.mark.slow
def test_vision_language_model_reads_its_images():
    """Gemma 3 writes its image features into the image tokens' embeddings (masked_scatter):
    the text stream and the projector's output are one class, the image features not an
    output by default."""
    m = randomized(MODELS["gemma3_text_config"]())
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.frozen == [] and r.certify(m) < 1e-9
    stream = r.group_of("model.language_model.embed_tokens.weight", 1)
    assert stream and stream == r.group_of("model.multi_modal_projector.mm_input_projection_weight", 1)
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved)
    got, want = al.apply(moved).state_dict(), m.state_dict()
    # the vision tower's pooling head is never run (Gemma 3 reads its last hidden state): any
    # map of its weights keeps the function, and weights alone cannot say which was applied
    used = [k for k in want if not k.startswith("model.vision_tower.head.")]
    assert len(used) < len(want) and max((got[k] - want[k]).abs().max().item() for k in used) < 1e-6

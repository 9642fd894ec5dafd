"""Issue 65: speech language models read their audio. ``symgraph.analyze(model)`` with no
inputs gives a speech language model the audio its own feature extractor makes (transformers'
class for the model type, built with its defaults and the config's mel bins) or, where there is
none, features of its audio config's shape, and in each row as many audio tokens as the model's
own ``get_audio_features`` or its encoder's output lengths count; the audio tower is then read,
its classes claimed and certified. One tiny model per mechanism."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs

T = pytest.importorskip("transformers")


def _text(**kw):
    return T.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, **kw)


def _claimed(rep, prefix) -> set:
    return {p for g in rep.groups if g.kind != "identity" for p, _ in g.params if p.startswith(prefix)}


def _params(m, prefix) -> set:
    return {n for n, _ in m.named_parameters() if n.startswith(prefix)}


def _reads_its_audio(m, tower: str, tol: float = 1e-6):
    rep = symgraph.analyze(m)
    assert rep.unread is None  # every parameter read: the tower's classes are not fixed
    claimed = _claimed(rep, tower)
    trained = {n for n, p in m.named_parameters() if p.requires_grad}  # not Voxtral's fixed sinusoids
    weights = {n for n in _params(m, tower) & trained if n.endswith("weight") and "norm" not in n}
    assert weights and weights <= claimed, sorted(weights - claimed)[:4]
    assert rep.certify(m) <= tol
    return rep


def test_qwen2_audio_whisper_features_counted_by_its_encoder_lengths():
    """Qwen2-Audio has no ``get_audio_features``: its feature extractor (Whisper's, at the
    config's 16 mel bins) pads half a second to 3000 frames with a mask of the 50 real ones,
    under the forward's name for it (``feature_attention_mask``); its encoder's output lengths
    of those frames count the audio tokens (12 per row)."""
    audio = T.Qwen2AudioEncoderConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=48,
                                      num_mel_bins=16)
    torch.manual_seed(0)
    m = T.Qwen2AudioForConditionalGeneration(T.Qwen2AudioConfig(audio_config=audio, text_config=_text(),
                                                                audio_token_index=63)).eval()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 16, 3000) and "attention_mask" not in kw
    assert kw["feature_attention_mask"].sum(-1).tolist() == [50, 50]
    _, want = m.model.audio_tower._get_feat_extract_output_lengths(kw["feature_attention_mask"].sum(-1))
    assert (kw["input_ids"] == 63).sum(1).tolist() == want.tolist() == [12, 12]
    _reads_its_audio(m, "model.audio_tower.")


@pytest.mark.slow
def test_vibevoice_asr_raw_samples_from_its_extractor_and_no_sampling():
    """VibeVoice ASR reads raw samples (``input_values``, its extractor's 24 kHz: half a second
    is 12800 samples with their ``padding_mask``), counted by its own ``get_audio_features``
    (4 latents per row after its 3200× downsampling); its forward draws its latents at random
    unless ``sample=False``, which the inputs say, so two runs agree and the certificate holds."""
    enc = dict(hidden_size=16, num_filters=4, depths=(1,) * 7)
    cfg = T.VibeVoiceAsrConfig(acoustic_tokenizer_encoder_config=enc, semantic_tokenizer_encoder_config=enc,
                               text_config=_text(), audio_token_id=63, audio_bos_token_id=61, audio_eos_token_id=62)
    torch.manual_seed(0)
    m = T.VibeVoiceAsrForConditionalGeneration(cfg).eval()
    _, kw = default_inputs(m)
    assert kw["input_values"].shape == (2, 1, 12800) and kw["padding_mask"].shape == (2, 12800)
    assert kw["sample"] is False
    with torch.no_grad():
        emb = m.get_audio_features(kw["input_values"], kw["padding_mask"], sample=False).pooler_output
    assert (kw["input_ids"] == 63).sum(1).tolist() == [4, 4] and emb[..., 0].numel() == 8
    _reads_its_audio(m, "model.acoustic_tokenizer_encoder.")


def test_omniasr_audio_written_by_a_mask_moved_by_dtype_keeps_the_text_stream():
    """OmniASR writes its audio embeddings into the audio tokens' embeddings by
    ``masked_scatter`` with the mask ``eq(ids).unsqueeze(-1).expand_as(embeds).to(device)``:
    the mask is the same along the hidden axis (``expand_as`` and ``to`` keep that), so each
    audio-token row is one projected row, channel for channel, and the text stream keeps its
    classes (it was fixed while ``expand_as``/``to`` hid the mask's uniformity)."""
    audio = T.OmniASRAudioConfig(hidden_size=32, conv_dim=[16] * 7, num_attention_heads=2, num_hidden_layers=1,
                                 num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=16, intermediate_size=48)
    torch.manual_seed(0)
    m = T.OmniASRForConditionalGeneration(T.OmniASRConfig(audio_config=audio, text_config=T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048), audio_token_id=63)).eval()
    _, kw = default_inputs(m)
    assert kw["input_values"].shape[-1] > 0 and (kw["input_ids"] == 63).sum().item() > 0
    rep = _reads_its_audio(m, "model.audio_tower.")
    stream = rep.group_of("model.language_model.embed_tokens.weight", 1)
    assert stream and all(g.kind != "identity" for g in stream)
    assert stream == rep.group_of("model.multi_modal_projector.weight", 0)
    assert not [f for f in rep.frozen if "masked_scatter" in str(f.op)]


def test_fun_asr_nano_features_stack_frames_of_mel_bins():
    """Fun-ASR-Nano's feature extractor needs torchaudio (not installed): features of its audio
    config's shape reach the encoder, whose frames stack ``num_stacked_frames`` consecutive
    mel frames (8 bins × 3 = 24 channels), with the forward's ``input_features_mask``; its own
    ``get_audio_features`` counts the audio tokens."""
    text = T.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    cfg = T.FunAsrNanoConfig(
        audio_config=dict(num_mel_bins=8, num_stacked_frames=3, hidden_size=32, num_attention_heads=2,
                          intermediate_size=48, num_hidden_layers=1, num_timestamp_prediction_layers=1),
        adaptor_config=dict(hidden_size=32, intermediate_size=8, num_attention_heads=2, num_hidden_layers=1,
                            projector_hidden_size=40),
        text_config=text, audio_token_id=63)
    torch.manual_seed(0)
    m = T.FunAsrNanoForConditionalGeneration(cfg).eval()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 64, 24) and kw["input_features_mask"].shape == (2, 64)
    with torch.no_grad():
        n = m.get_audio_features(kw["input_features"], kw["input_features_mask"]).pooler_output.shape[0]
    assert (kw["input_ids"] == 63).sum().item() == n == 128
    _reads_its_audio(m, "model.audio_tower.")


def test_nemotron_transcribe_nested_mel_bins_and_frames_padded_to_the_subsampling():
    """Nemotron 3.5 Transcribe states its mel bins two configs deep
    (``audio_config.asr_config.num_mel_bins``): its own feature extractor is built at 16 bins,
    and its 51 frames are padded on the right to a multiple of ``subsampling_factor`` (8), the
    mask 0 there, as its processor does (its encoder refuses any other length); the audio
    tokens are as many as ``get_audio_features`` gives, and the logits depend on the audio."""
    layers = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, num_mel_bins=16, subsampling_factor=8)
    text = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    audio = dict(asr_config=layers, diarization_config=dict(
        audio_config=layers, head_config=dict(hidden_size=32, audio_hidden_size=32)))
    torch.manual_seed(0)
    m = T.Nemotron3_5TranscribeForConditionalGeneration(T.Nemotron3_5TranscribeConfig(
        audio_config=audio, text_config=text, audio_token_id=63)).eval()
    _, kw = default_inputs(m)
    feats, mask = kw["input_features"], kw["input_features_mask"]
    assert feats.shape == (2, 56, 16) and mask.shape == (2, 56)
    assert not mask[:, 51:].any() and (feats[:, 51:] == 0).all()
    with torch.no_grad():
        n = m.get_audio_features(feats, mask).pooler_output.shape[0]
        base = m(**kw).logits
        other = m(**{**kw, "input_features": torch.randn_like(feats)}).logits
    assert (kw["input_ids"] == 63).sum().item() == n == 14
    assert (base - other).abs().max().item() > 1e-4


def test_granite_speech_optional_mask_of_projected_features_left_out():
    """Granite Speech's extractor needs torchaudio (not installed): features of its encoder
    config's shape (``input_dim`` channels, frames first) reach the encoder. Its forward's
    ``input_features_mask`` masks the projected features, not the frames: the all-ones frame
    mask does not fit, so the inputs leave the optional mask out, and the audio tokens are as
    many as its Q-Former projector gives (15 per row); the encoder is read and claimed."""
    text = dict(model_type="granite", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    enc = dict(input_dim=8, hidden_dim=32, num_layers=2, num_heads=2, dim_head=16, output_dim=6, context_size=16,
               conv_kernel_size=3, feedforward_mult=2)
    proj = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                encoder_hidden_size=32, vocab_size=64)
    torch.manual_seed(0)
    m = T.GraniteSpeechForConditionalGeneration(T.GraniteSpeechConfig(
        text_config=text, encoder_config=enc, projector_config=proj, audio_token_id=63)).eval()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 64, 8) and "input_features_mask" not in kw
    with torch.no_grad():
        emb = m.get_audio_features(kw["input_features"]).pooler_output
    assert (kw["input_ids"] == 63).sum(1).tolist() == [emb.shape[1]] * 2 == [15, 15]
    _reads_its_audio(m, "model.encoder.")


def test_voxtral_reads_its_audio_where_its_config_states_the_audio_token():
    """Voxtral's default config leaves ``audio_token_id`` None (its checkpoints state 24, the
    id ``VoxtralProcessor`` hard-codes): no id is guessed, so a config without one gets text
    only (the report then names the audio tower unread). With the id stated, Whisper's
    extractor pads to 3000 frames and the encoder's 1000 embeddings per row are its tokens."""
    audio = T.VoxtralEncoderConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                   num_mel_bins=16)
    text = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    unstated = T.VoxtralForConditionalGeneration(T.VoxtralConfig(audio_config=audio, text_config=text)).eval()
    assert "input_features" not in default_inputs(unstated)[1]
    m = T.VoxtralForConditionalGeneration(T.VoxtralConfig(audio_config=audio, text_config=text,
                                                          audio_token_id=63)).eval()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape == (2, 16, 3000) and (kw["input_ids"] == 63).sum(1).tolist() == [1000, 1000]
    _reads_its_audio(m, "model.audio_tower.")


@pytest.mark.slow
def test_apertus_audio_tokenizer_counted_by_its_per_clip_features():
    """Apertus 1.5 tokenizes each clip alone (``get_audio_features`` gives one tensor of
    embeddings per clip): as many audio tokens per row as its clip gives codes (20 for half a
    second at a hop of 600 samples); before, none was counted and the tokenizer stayed unread."""
    text = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, pad_token_id=3, bos_token_id=1, eos_token_id=2)
    vision = dict(codebook_size=16, embed_dim=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                  num_res_blocks=1, attn_resolutions=[], resolution=32)
    audio = dict(sampling_rate=24000, num_filters=8, upsampling_ratios=[6, 5, 5, 4], num_residual_layers=1,
                 num_lstm_layers=1, hidden_size=32, codebook_size=16, codebook_dim=32, decoder_hidden_size=32,
                 decoder_intermediate_size=48, decoder_num_layers=1)
    cfg = T.Apertus1p5Config(text_config=text, vision_config=vision, audio_config=audio, image_token_id=254,
                             audio_token_id=255, image_token_offset=125, audio_token_offset=141)
    torch.manual_seed(0)
    m = T.Apertus1p5ForConditionalGeneration(cfg).eval()
    _, kw = default_inputs(m)
    assert kw["input_values"].shape == (2, 1, 12000) and kw["padding_mask"].shape == (2, 12000)
    assert (kw["input_ids"] == 255).sum(1).tolist() == [20, 20]
    with torch.no_grad():
        codes = m.model.get_audio_tokens(kw["input_values"], kw["padding_mask"])
    assert [len(c) for c in codes] == [20, 20]

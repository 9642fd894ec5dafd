"""Issue 65, coverage rows of speech and detection that failed in the eager run: each failure
was our example inputs, fixed where the mechanism is. One tiny model per mechanism; each runs
eagerly on ``default_inputs(model)`` and ``symgraph.analyze(model)`` with no inputs claims the
tower the fix makes it read, and certifies."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.deadcode import DEAD
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


def test_omniasr_ctc_raw_samples_from_its_extractor_with_a_channel_axis():
    """OmniASR's CTC model reads raw samples as ``batch × 1 × samples``: the config's shape
    (``batch × samples``) is refused, so the inputs are what its own feature extractor makes of
    half a second at 16 kHz (8000 samples, with its all-ones ``padding_mask``)."""
    audio = T.OmniASRAudioConfig(hidden_size=32, conv_dim=[16] * 7, num_attention_heads=2, num_hidden_layers=1,
                                 num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=16, intermediate_size=48)
    torch.manual_seed(0)
    m = T.OmniASRForCTC(T.OmniASRCTCConfig(audio_config=audio, vocab_size=40)).eval()
    _, kw = default_inputs(m)
    assert kw["input_values"].shape == (2, 1, 8000)
    assert kw["padding_mask"].shape == (2, 8000) and bool(kw["padding_mask"].all())
    with torch.no_grad():
        logits = m(**kw).logits
    n = 8000
    for k, s in zip(audio.conv_kernel, audio.conv_stride):  # the convolutions' frames: 24
        n = (n - k) // s + 1
    assert logits.shape == (2, n, 40) and n == 24
    _certified_and_claims(m, [""])


def test_granite_speech5_ctc_features_as_wide_as_the_linear_that_reads_them():
    """Granite Speech 5's encoder reads ``4 × num_mel_bins`` features a frame (its extractor
    stacks two frames of bins and their deltas; it needs torchaudio, absent here): the config's
    16 bins are refused, and the frames are rebuilt as wide as the first linear map that reads
    them takes (64)."""
    enc = T.GraniteSpeech5EncoderConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, num_mel_bins=16, max_position_embeddings=64,
                                        context_size=16)
    torch.manual_seed(0)
    m = T.GraniteSpeech5ForCTC(T.GraniteSpeech5CTCConfig(encoder_config=enc, vocab_size=24)).eval()
    _, kw = default_inputs(m)
    x = kw["input_features"]
    assert x.shape[0] == 2 and x.shape[-1] == 64 == 4 * 16
    with torch.no_grad():
        assert m(**kw).logits.shape[-1] == 24
    _certified_and_claims(m, [""])


def _dia():
    enc = T.DiaEncoderConfig(max_position_embeddings=64, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=16, intermediate_size=48, vocab_size=64)
    dec = T.DiaDecoderConfig(max_position_embeddings=64, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, cross_num_attention_heads=2,
                             cross_head_dim=16, cross_num_key_value_heads=2, cross_hidden_size=32, vocab_size=40,
                             num_channels=3, pad_token_id=39, eos_token_id=38, bos_token_id=37)
    torch.manual_seed(0)
    return T.DiaForConditionalGeneration(T.DiaConfig(encoder_config=enc, decoder_config=dec,
                                                     delay_pattern=[0, 1, 2])).eval()


def test_dia_decoder_ids_a_column_per_channel_of_its_decoder_vocabulary():
    """Dia's decoder reads one audio code per channel a position (``decoder_config.num_channels``):
    ids of one a position are refused, so they are ``batch × positions × 3``, in range of the
    decoder's own vocabulary (40, not the encoder's 64), avoiding its special tokens after the
    start token (its ``bos_token_id``) that begins every channel."""
    m = _dia()
    _, kw = default_inputs(m)
    dec = kw["decoder_input_ids"]
    assert dec.shape == (2, 5, 3) and kw["input_ids"].shape == (2, 8)
    assert dec[:, 0].eq(37).all() and int(dec[:, 1:].max()) < 37
    with torch.no_grad():
        assert m(**kw).logits.shape[-1] == 40
    _certified_and_claims(m, ["model.encoder.layers.", "model.decoder.layers."])


# --- detectors: sizes the shrink rule derives from the backbone (benchmarks/coverage/derived.py)


def test_feature_width_follows_the_backbone_stage_it_reads():
    """A detector's width named for a feature map whose default is a backbone stage's output
    channels follows that stage: scaled with the detector (128 -> 32) it would no longer match
    an unscaled backbone's 128, so it takes the backbone's shrunk value; a width that matches no
    stage, or is not named for a feature, is left as the rule made it."""
    from types import SimpleNamespace

    from benchmarks.coverage.derived import feature_widths
    old = SimpleNamespace(stage_out_channels=[128, 512], stage_in_channels=[48, 128], hidden_sizes=[256, 512],
                          to_dict=dict)
    fields = {"backbone_config": old, "x4_feat_dim": 128, "encoder_hidden_dim": 256, "y_feat_dim": 96}
    new_bb = {"stage_out_channels": [128, 512], "stage_in_channels": [48, 128], "hidden_sizes": [256, 512]}
    out = {"backbone_config": new_bb, "x4_feat_dim": 32, "encoder_hidden_dim": 64, "y_feat_dim": 24}
    assert feature_widths(fields, out) == {"x4_feat_dim": 128}
    out["backbone_config"] = {**new_bb, "stage_out_channels": [32, 128]}
    assert feature_widths(fields, out) == {"x4_feat_dim": 32}


def test_object_queries_no_more_than_the_patches_of_the_shrunk_image():
    from benchmarks.coverage.derived import object_queries
    bb = {"image_size": 64, "patch_size": 14}
    assert object_queries({"num_queries": 300}, {"backbone_config": bb}) == {"num_queries": 16}
    assert object_queries({"num_queries": 10}, {"backbone_config": bb}) == {}
    assert object_queries({"num_queries": 300}, {"backbone_config": {"image_size": 64}}) == {}


def test_pp_doclayout_v3_mask_head_reads_the_backbone_stage_it_is_sized_for():
    """PP-DocLayout V3's tiny config: ``x4_feat_dim`` stays the HGNet-V2 backbone's first stage's
    128 channels (scaled to 32 the mask head's convolution refused them), and the model runs."""
    from benchmarks.coverage.shrink import build, tiny_config
    cfg, _ = tiny_config("pp_doclayout_v3")
    assert cfg.x4_feat_dim == cfg.backbone_config.stage_out_channels[0] == 128
    m, _ = build("pp_doclayout_v3", "PPDocLayoutV3ForObjectDetection")
    _, kw = default_inputs(m)
    with torch.no_grad():
        out = m(**kw)
    assert out.logits.shape[:2] == (2, cfg.num_queries)


@pytest.mark.slow
def test_rf_detr_runs_and_names_the_training_only_query_groups():
    """RF-DETR's tiny config takes 16 queries, the patches of its backbone's 64-pixel image in
    14-pixel patches (300 could not be taken as the top-k of 16 proposals), and runs. In eval
    mode it reads only the first of its ``group_detr`` query groups (the others are Group DETR's
    training-time queries): a run of its model in training mode reads them, its backbone's mask
    token is proven dead (no caller passes ``bool_masked_pos``), so every parameter is read or
    dead and the other groups' projections join their classes; it certifies."""
    from benchmarks.coverage.shrink import build
    m, _ = build("rf_detr", "RfDetrForObjectDetection")
    assert m.config.num_queries == 16 and m.config.group_detr > 1
    _, kw = default_inputs(m)
    with torch.no_grad():
        assert m(**kw).logits.shape == (2, 16, m.config.num_labels)
    rep = symgraph.analyze(m)
    assert rep.unread is None
    assert "model.backbone.backbone.embeddings.mask_token" in rep.exported_program.graph_module.meta[DEAD]
    # a training-time group's box head: its hidden units (ReLU) scale and permute
    assert [g.kind for g in rep.group_of("model.enc_out_bbox_embed.1.layers.0.weight", 0)] == ["scaled_perm"]
    assert rep.certify(m) <= 1e-6


@pytest.mark.slow
def test_led_first_token_global_reads_the_global_projections():
    """LED's encoder (Longformer's attention) reads its global query/key/value projections only
    on a branch a globally attending token takes (``aten.any`` of the mask): the inputs mark the
    first token of each row global (``global_attention_mask``), so the traced program reads
    them, their classes are claimed, and the report certifies."""
    cfg = T.LEDConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, attention_window=[4],
                      max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, pad_token_id=1,
                      eos_token_id=2, bos_token_id=0, decoder_start_token_id=2)
    torch.manual_seed(0)
    m = T.LEDForConditionalGeneration(cfg).eval()
    _, kw = default_inputs(m)
    g = kw["global_attention_mask"]
    assert g.shape == kw["input_ids"].shape and g[:, 0].eq(1).all() and int(g.sum()) == g.shape[0]
    rep = _certified_and_claims(m, ["led.encoder.layers.0.self_attn.longformer_self_attn.query_global",
                                    "led.encoder.layers.0.self_attn.longformer_self_attn.value_global"])
    assert rep.group_of("led.encoder.layers.0.self_attn.longformer_self_attn.query_global.weight", 0)


@pytest.mark.slow
def test_kyutai_ids_a_text_column_and_one_per_codebook_codec_named_unread():
    """Kyutai's speech-to-text forward reads, a position, its text token and one audio code per
    codebook (``batch × positions × (num_codebooks + 1)``); one row per example is refused, and
    so are ``batch × num_codebooks`` rows and a column per codebook alone. Its codec (Mimi)
    turns audio into those codes only in ``generate``: the forward never reads it, so it runs on
    its own example audio beside the forward (a sub-model's entry point), its units are claimed,
    and it certifies."""
    from benchmarks.coverage.shrink import build
    m, _ = build("kyutai_speech_to_text", "KyutaiSpeechToTextForConditionalGeneration")
    books = m.config.num_codebooks
    _, kw = default_inputs(m)
    ids = kw["input_ids"]
    assert ids.shape == (2, 8, books + 1) and int(ids.max()) < m.config.vocab_size
    with torch.no_grad():
        assert m(**kw).logits.shape == (2, 8, m.config.vocab_size)
    rep = symgraph.analyze(m)
    assert rep.unread is None
    mlp = rep.group_of("codec_model.encoder.encoder_transformer.layers.0.mlp.fc1.weight", 0)
    assert [g.kind for g in mlp] == ["perm"]
    assert rep.certify(m) <= 1e-6

"""Example inputs a forward needs beside its main one (symgraph/passes/paired_inputs.py): each
model runs eagerly on ``default_inputs(model)`` and, where it traces, ``symgraph.analyze(model)``
with no inputs certifies."""
import pytest
import torch
import transformers as T

import symgraph
from symgraph.passes.inputs import default_inputs

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def _vision(**kw):
    return dict(SMALL, image_size=28, patch_size=14, **kw)


def _run(model):
    args, kwargs = default_inputs(model)
    with torch.no_grad():
        out = model(*args, **kwargs)
    return kwargs, out


def _blip():
    cfg = T.BlipConfig(text_config=dict(SMALL, vocab_size=64, encoder_hidden_size=32, max_position_embeddings=32),
                       vision_config=_vision(), projection_dim=16, image_text_hidden_size=32)
    torch.manual_seed(0)
    return T.BlipForConditionalGeneration(cfg).eval()


def _kosmos2():
    cfg = T.Kosmos2Config(
        text_config=dict(vocab_size=64, embed_dim=32, layers=1, ffn_dim=64, attention_heads=4,
                         max_position_embeddings=64),
        vision_config=_vision(), latent_query_num=4)
    torch.manual_seed(0)
    return T.Kosmos2ForConditionalGeneration(cfg).eval()


def _xmod(languages=("en_XX", "de_DE")):
    cfg = T.XmodConfig(vocab_size=64, max_position_embeddings=40, languages=list(languages), **SMALL)
    torch.manual_seed(0)
    return T.XmodForMaskedLM(cfg).eval()


def test_blip_captioner_reads_text_beside_its_images():
    model = _blip()
    kwargs, out = _run(model)
    ids = kwargs["input_ids"]
    assert kwargs["pixel_values"].shape == (2, 3, 28, 28)
    assert ids.shape == (2, 8) and int(ids.max()) < 64
    assert out.logits.shape == (2, 8, 64)


def test_kosmos2_image_positions_hold_one_embedding_per_query():
    model = _kosmos2()
    kwargs, out = _run(model)
    mask, ids = kwargs["image_embeds_position_mask"], kwargs["input_ids"]
    assert mask.shape == ids.shape == (2, 12)
    assert mask.sum(1).tolist() == [4, 4]  # latent_query_num positions a row
    assert not mask[:, 0].any() and mask[:, 1:5].all()
    assert out.logits.shape == (2, 12, 64)


def test_kosmos2_analyze_needs_no_inputs_and_certifies():
    model = _kosmos2()
    report = symgraph.analyze(model)
    assert report.groups
    assert report.certify(model) <= 1e-6


@pytest.mark.parametrize("languages, expect", [(("en_XX",), [0, 0]), (("en_XX", "de_DE"), [0, 1])])
def test_xmod_rows_each_name_a_language(languages, expect):
    model = _xmod(languages)
    kwargs, out = _run(model)
    assert kwargs["lang_ids"].tolist() == expect
    assert out.logits.shape == (2, 8, 64)


def test_xmod_without_languages_given_refuses_as_transformers_does():
    model = _xmod()
    args, kwargs = default_inputs(model)
    kwargs.pop("lang_ids")
    with pytest.raises(ValueError, match="Input language unknown"):
        model(*args, **kwargs)


def test_naflex_classifier_reads_rows_of_patches_with_their_grid():
    cfg = T.Siglip2Config(vision_config=dict(SMALL, patch_size=4, num_patches=16),
                          text_config=dict(SMALL, vocab_size=64))
    torch.manual_seed(0)
    model = T.Siglip2ForImageClassification(cfg).eval()
    kwargs, out = _run(model)
    n = kwargs["spatial_shapes"].prod(-1)
    assert kwargs["pixel_values"].shape == (2, int(n[0]), 3 * 4 * 4)
    assert kwargs["pixel_attention_mask"].all() and kwargs["pixel_attention_mask"].shape == (2, int(n[0]))
    assert out.logits.shape == (2, 2)


def test_video_frames_each_take_their_query_tokens():
    """InstructBLIP-Video: the main images are a video's frames; each frame's queries take as
    many video tokens; the Q-Former's instruction is of its own vocabulary."""
    cfg = T.InstructBlipVideoConfig(
        vision_config=_vision(), qformer_config=dict(SMALL, vocab_size=40, encoder_hidden_size=32),
        text_config=dict(model_type="opt", vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                         num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64),
        num_query_tokens=3, video_token_index=63)
    torch.manual_seed(0)
    model = T.InstructBlipVideoForConditionalGeneration(cfg).eval()
    kwargs, out = _run(model)
    assert kwargs["pixel_values"].shape == (2, 2, 3, 28, 28)
    assert (kwargs["input_ids"] == 63).sum(1).tolist() == [6, 6]  # 3 queries x 2 frames
    assert int(kwargs["qformer_input_ids"].max()) < 40 and kwargs["qformer_attention_mask"].all()
    assert out.logits.shape[-1] == 64


def test_a_decoder_of_codebooks_takes_one_row_of_ids_per_codebook():
    cfg = T.MusicgenDecoderConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_codebooks=3, max_position_embeddings=32)
    torch.manual_seed(0)
    model = T.MusicgenForCausalLM(cfg).eval()
    kwargs, out = _run(model)
    assert kwargs["input_ids"].shape == (2 * 3, 8) and int(kwargs["input_ids"].max()) < 64
    assert out.logits.shape == (2 * 3, 8, 64)  # a row of logits per example and codebook


def test_idefics_tokens_each_attend_to_the_rows_one_image():
    cfg = T.IdeficsConfig(vocab_size=64, additional_vocab_size=0, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, cross_layer_interval=1,
                          max_position_embeddings=32,
                          vision_config=dict(embed_dim=32, image_size=28, patch_size=14, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4),
                          perceiver_config=dict(use_resampler=False))
    torch.manual_seed(0)
    model = T.IdeficsForVisionText2Text(cfg).eval()
    kwargs, out = _run(model)
    assert kwargs["pixel_values"].shape == (2, 1, 3, 28, 28)
    assert kwargs["image_attention_mask"].shape == (2, 8, 1) and kwargs["image_attention_mask"].all()
    assert out.logits.shape == (2, 8, 64)

"""Sizes the shrink rule derives so that a family's model runs at the shrunk width (issue 65):
a layout embedding's coordinate and shape parts fill the width (LayoutLMv3), a per-stage depth
list keeps stage ``i`` deeper than ``i`` where the default does (CvT), a scaled convolutional
family's width multiplier follows its main width (EfficientNet). Each row then runs, traces,
certifies and is complete on ``symgraph.analyze(model)`` with no inputs."""
from __future__ import annotations

import pytest

from benchmarks import coverage as cov
from benchmarks.tests.rows import row_sound_and_complete
from benchmarks.coverage.consistent import layout_parts, multipliers, stage_depths


def test_layout_parts_fill_the_shrunk_width():
    assert layout_parts({"coordinate_size": 128, "shape_size": 128}, 768, 64) == \
        {"coordinate_size": 10, "shape_size": 12}  # 4 × 10 + 2 × 12 = 64
    assert layout_parts({"coordinate_size": 128, "shape_size": 128}, 768, 48) == \
        {"coordinate_size": 8, "shape_size": 8}
    assert layout_parts({"coordinate_size": 100, "shape_size": 128}, 768, 64) == {}  # no such sum
    assert layout_parts({"coordinate_size": 128}, 768, 64) == {}
    cfg, _ = cov.tiny_config("layoutlmv3")
    assert 4 * cfg.coordinate_size + 2 * cfg.shape_size == cfg.hidden_size == cov.HIDDEN


def test_stage_depths_stay_deeper_than_their_index():
    assert stage_depths({"depth": [1, 2, 10]}, {"depth": [1, 1, 1]}) == {"depth": [1, 2, 3]}
    assert stage_depths({"depth": (1, 2, 10)}, {"depth": (1, 1, 1)}) == {"depth": (1, 2, 3)}
    assert stage_depths({"depths": [2, 2, 6, 2]}, {"depths": [1, 1, 1, 1]}) == {}  # Swin's: no such default
    assert stage_depths({"depth": [1, 2, 10]}, {"depth": [1, 2, 3]}) == {}  # already so
    cfg, _ = cov.tiny_config("cvt")
    assert list(cfg.depth) == [1, 2, 3]


def test_width_multiplier_follows_the_main_width():
    assert multipliers({"width_coefficient": 2.0, "depth_coefficient": 3.1}, 2560, 64) == \
        {"width_coefficient": 0.05, "depth_coefficient": 1.0}
    assert multipliers({"width_coefficient": 2.0, "depth_coefficient": 3.1}, 64, 64) == {}  # not shrunk
    assert multipliers({"width_multiplier": 1.0}, 2560, 64) == {}
    cfg, _ = cov.tiny_config("efficientnet")
    assert cfg.hidden_dim == cov.HIDDEN and cfg.width_coefficient == 0.05 and cfg.depth_coefficient == 1.0


@pytest.mark.slow
def test_rows_run_and_are_complete():
    r = row_sound_and_complete("efficientnet", "EfficientNetForImageClassification", "image_cls")
    assert r["group_kinds"].get("perm", 0) > 0
    row_sound_and_complete("layoutlmv3", "LayoutLMv3ForSequenceClassification", "seq_cls")


@pytest.mark.slow
def test_mrope_sections_a_model_reads_with_its_own_default():
    """PaddleOCR-VL's text model reads ``rope_parameters.get("mrope_section", [16, 24, 24])``
    (64 = half its 128-wide heads), a key its config names nowhere: the shrunk config states
    sections summing to half the shrunk head width. A family whose code reads none gets none."""
    from transformers import CONFIG_MAPPING

    from benchmarks.coverage.consistent import read_with_default
    assert read_with_default(CONFIG_MAPPING["paddleocr_vl"]().text_config, "mrope_section")
    assert not read_with_default(CONFIG_MAPPING["llama"](), "mrope_section")
    cfg, _ = cov.tiny_config("paddleocr_vl")
    text = cfg.text_config
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2 == 8
    assert "mrope_section" not in (cov.tiny_config("llama")[0].rope_parameters or {})
    row_sound_and_complete("paddleocr_vl", "PaddleOCRVLForConditionalGeneration", "image_text_to_text")


@pytest.mark.slow
def test_token_ids_a_model_reads_with_its_own_default():
    """ShieldGemma 2 selects the logits of ``getattr(config, "yes_token_index", 10_784)`` and
    ``"no_token_index"`` (3771), ids its config does not declare: beyond the shrunk vocabulary
    they index past the logits, so the shrunk config states them, below the renumbered ones."""
    from transformers import CONFIG_MAPPING

    from benchmarks.coverage.derived import code_token_ids
    sg = CONFIG_MAPPING["shieldgemma2"]()
    assert code_token_ids(sg, {}, 251) == {"yes_token_index": 251, "no_token_index": 250}
    assert code_token_ids(sg, {"yes_token_index": 7}, 251) == {"no_token_index": 251}  # declared: kept
    assert code_token_ids(sg, {}, 20_000) == {}  # both defaults within the vocabulary
    assert code_token_ids(CONFIG_MAPPING["llama"](), {}, 251) == {}
    cfg, _ = cov.tiny_config("shieldgemma2")
    ids = {cfg.yes_token_index, cfg.no_token_index}
    assert max(ids) < cfg.text_config.vocab_size and len(ids) == 2
    assert not ids & {cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index}
    row_sound_and_complete("shieldgemma2", "ShieldGemma2ForImageClassification", "image_cls")


def test_layers_all_sharing_a_cache_stay_all():
    """Gemma 4's unified assistant reads every layer's key-value cache from its target model
    (``num_kv_shared_layers`` = ``num_hidden_layers`` = 30); shrunk to one shared layer of two,
    its validator refuses the layer kind that the unshared one makes and nothing reads."""
    from benchmarks.coverage.consistent import all_shared
    fields = {"num_hidden_layers": 30, "num_kv_shared_layers": 30, "max_window_layers": 30}
    assert all_shared(fields, {"num_hidden_layers": 2}) == {"num_kv_shared_layers": 2}
    assert all_shared({"num_hidden_layers": 30, "num_kv_shared_layers": 20}, {"num_hidden_layers": 2}) == {}
    cfg, _ = cov.tiny_config("gemma4_unified_assistant")
    text = cfg.get_text_config()
    assert text.num_kv_shared_layers == text.num_hidden_layers == 2
    assert text.kv_sharing_modes == ["reuse", "reuse"]
    cov.build("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM")  # builds (it did not)


def test_widths_the_model_code_divides_by_a_literal():
    """LiLT's layout embedding joins six ``config.hidden_size // 6`` parts into a linear of
    width ``hidden_size`` (768 = 6 × 128): the shrunk 64 is no multiple of 6, so it becomes the
    least common multiple 192 (still a multiple of the heads and the channel shrink ratio);
    a width the code divides by a power of two that the shrunk one already is stays."""
    from transformers import CONFIG_MAPPING

    from benchmarks.coverage.consistent import divided_widths, model_source
    src = "a = nn.Linear(config.hidden_size // 6, 2)\nb = config.intermediate_size // 4\n"
    fields = {"hidden_size": 768, "intermediate_size": 3072}
    assert divided_widths(None, fields, {"hidden_size": 64, "intermediate_size": 256}, src) == {"hidden_size": 192}
    assert divided_widths(None, fields, {"hidden_size": 48}, src) == {}  # already a multiple
    assert divided_widths(None, {"hidden_size": 760}, {"hidden_size": 64}, src) == {}  # nor is the default
    assert divided_widths(None, fields, {}, src) == {}  # not shrunk: the default's own
    assert "config.hidden_size // 6" in model_source(CONFIG_MAPPING["lilt"]())
    assert divided_widths(CONFIG_MAPPING["llama"](), {"hidden_size": 4096}, {"hidden_size": 64}) == {}
    cfg, overrides = cov.tiny_config("lilt")
    assert cfg.hidden_size == overrides["hidden_size"] == 192
    assert cfg.hidden_size % 6 == 0 and cfg.hidden_size % (cfg.num_attention_heads * cfg.channel_shrink_ratio) == 0
    r = row_sound_and_complete("lilt", "LiltForSequenceClassification", "seq_cls")
    assert r["group_kinds"].get("perm", 0) > 0


def test_channels_beside_stage_multipliers_are_widths():
    """Apertus 1.5's vision tokenizer is a convolutional encoder of ``base_channels`` 256 ×
    ``channel_multiplier`` (1, 1, 2, 2, 4) a stage into ``latent_channels`` 256 (its codebook's
    ``embed_dim`` 256): its channels scale as its width (184.6M of the row's 185M parameters
    were its, unshrunk), none below the shrunk width; the image's 3 channels and a level
    without multipliers stay."""
    from benchmarks.coverage.consistent import multiplied_channels
    fields = {"embed_dim": 256, "base_channels": 256, "latent_channels": 256, "in_channels": 3,
              "channel_multiplier": [1, 1, 2, 2, 4]}
    assert multiplied_channels(fields, 256, 64) == {"base_channels": 64, "latent_channels": 64}
    assert multiplied_channels({**fields, "base_channels": 128}, 256, 64) == \
        {"base_channels": 64, "latent_channels": 64}  # 32: none below the width
    # Emu3's VQ-VAE: 256 base channels beside a width of 1024 -> 64, not 16 (GroupNorm of 32 groups)
    assert multiplied_channels({**fields, "latent_channels": 4}, 1024, 64) == {"base_channels": 64}
    assert multiplied_channels(fields, 256, 256) == {}  # not shrunk
    del fields["channel_multiplier"]
    assert multiplied_channels(fields, 256, 64) == {}  # no stages multiplied: channels of their own
    cfg, _ = cov.tiny_config("apertus1p5")
    v = cfg.vision_config
    assert (v.embed_dim, v.base_channels, v.latent_channels, v.in_channels) == (64, 64, 64, 3)
    assert cov.tiny_config("emu3")[0].vq_config.base_channels == 64
    model, _ = cov.build("apertus1p5", "Apertus1p5ForConditionalGeneration")
    assert sum(p.numel() for p in model.model.vision_tokenizer.parameters()) < 12_000_000  # was 184.6M


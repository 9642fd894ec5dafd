"""The shrink rule keeps each config's own validators (issue 65): lists with one entry per
qualified layer, the layers a head reads, a backbone's stages, widths a list repeats, and a
timm backbone replaced by the config's own when timm is absent; the rows then trace, certify
and are complete with ``symgraph.analyze(model)`` on no inputs. What transformers itself cannot
build or run is counted apart from the denominator."""
from __future__ import annotations

import importlib.util

import pytest

from benchmarks import coverage as cov
from benchmarks.tests.rows import row_sound_and_complete


@pytest.mark.slow
def test_per_layer_list_follows_its_qualified_count():
    # Speech2Text: len(conv_kernel_sizes) == num_conv_layers is a validator of its config
    cfg, over = cov.tiny_config("speech_to_text")
    assert cfg.num_conv_layers == 1 and len(cfg.conv_kernel_sizes) == 1
    assert over["conv_kernel_sizes"] == type(over["conv_kernel_sizes"])(cfg.conv_kernel_sizes)
    r = row_sound_and_complete("speech_to_text", "Speech2TextForConditionalGeneration", "speech_seq2seq")
    assert r["structure"]["multihead_attention"] >= 4


@pytest.mark.slow
def test_layers_a_head_reads_keep_their_number():
    # DPT's neck reads 4 layers' outputs (one per neck width): 4 indices, one layer more
    cfg, _ = cov.tiny_config("dpt")
    assert len(cfg.backbone_out_indices) == len(cfg.neck_hidden_sizes) == 4
    assert cfg.num_hidden_layers == 5 and list(cfg.backbone_out_indices) == [1, 2, 3, 4]
    # the row builds, runs and traces; transformers' forward never hands the neck's first fusion
    # layer a residual, so the trace runs that layer again on one (symgraph.passes.holder_inputs)
    # and its residual_layer1 no longer fixes every class: sound and complete
    r = cov.run_family("dpt", "DPTForSemanticSegmentation", "semantic_segmentation")
    assert r["error"] is None and r["traced"] and r["stage"] == "done" and r["sound"]
    assert r["complete"] and not r["structure"]["missing"]


@pytest.mark.slow
def test_backbone_stages_and_repeated_widths_are_kept_consistent():
    # UperNet: the ResNet backbone's out_indices (not a declared field) are passed on
    cfg, _ = cov.tiny_config("upernet")
    assert list(cfg.backbone_config.out_indices) == [1, 2, 3, 4]
    # RT-DETR: the decoder's input widths repeat the encoder's width, shrunk with it
    cfg, _ = cov.tiny_config("rt_detr")
    assert list(cfg.backbone_config.out_indices) == [2, 3, 4]
    assert list(cfg.decoder_in_channels) == [cfg.encoder_hidden_dim] * 3 == [64] * 3
    row_sound_and_complete("upernet", "UperNetForSemanticSegmentation", "semantic_segmentation")


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm installed: its backbone is kept")
def test_timm_backbone_replaced_by_the_configs_own():
    cfg, over = cov.tiny_config("detr")
    assert cfg.backbone_config.model_type == "resnet" and over["use_timm_backbone"] is False
    assert over["use_pretrained_backbone"] is False


def test_what_transformers_cannot_build_or_run_is_apart_from_the_denominator():
    # BEiT's default config reads one layer; its segmentation head demands four: transformers' own
    beit = cov.run_family("beit", "BeitForSemanticSegmentation", "semantic_segmentation")
    assert beit["error"]["stage"] == "build" and "out_indices" in beit["error"]["message"]
    ok = {"model_type": "x", "class": "X", "task": "ctc", "traced": True, "sound": True,
          "complete": True, "certificate": 0.0, "error": None}
    ran = {**ok, "model_type": "y", "traced": False, "sound": None, "complete": None,
           "error": {"stage": "eager", "type": "RuntimeError", "message": "shape"}}
    ours = {**ran, "model_type": "z", "error": {"stage": "trace", "type": "TraceError", "message": "guard"}}
    beit = {**beit, "task": "ctc"}
    c = cov.summarize([ok, ran, ours, beit])["by_task"]["ctc"]
    assert (c["tried"], c["cannot_build"], c["cannot_run"], c["runs"]) == (4, 1, 1, 2)
    assert c["sound_and_complete"] == 1 and c["fraction"] == 0.5 and not c["meets_target"]


@pytest.mark.parametrize("model_type, heads, dim, expand", [
    ("mamba2", "num_heads", "head_dim", "expand"), ("bamba", "mamba_n_heads", "mamba_d_head", "mamba_expand")])
def test_state_space_heads_times_head_width_is_expand_times_width(model_type, heads, dim, expand):
    # Mamba 2's and Bamba's validators: heads × head width = expand × hidden (128 = 4 × 32)
    cfg, over = cov.tiny_config(model_type)
    assert getattr(cfg, heads) * getattr(cfg, dim) == getattr(cfg, expand) * cfg.hidden_size == 2 * cov.HIDDEN
    assert over[dim] == 32 and getattr(cfg, heads) == 4


def test_head_width_and_kv_heads_left_none_are_derived():
    # Ministral reads config.head_dim as is (None: None ** -0.5); Nemotron divides by its
    # num_key_value_heads (None by default): the shrunk config states them
    cfg, over = cov.tiny_config("ministral")
    assert over["head_dim"] == cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads == 16
    cfg, over = cov.tiny_config("nemotron")
    assert over["num_key_value_heads"] == cfg.num_key_value_heads == cfg.num_attention_heads == 4
    row_sound_and_complete("ministral", "MinistralForCausalLM", "causal_lm")

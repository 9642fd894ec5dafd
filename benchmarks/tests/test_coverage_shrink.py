"""The shrink rule derives consistent sizes from what each config validates (issue 65), and a
row counts as one transformers cannot build only when transformers' own default config fails
the same way: a failure of the shrink rule or of our example inputs counts against us."""
from __future__ import annotations

import pytest
import torch

from benchmarks import coverage as cov
from benchmarks.coverage.consistent import split_to
from benchmarks.coverage.family import run_eagerly, transformers_fails
from benchmarks.coverage.at_default import fails_at_default
from symgraph.passes.inputs import default_inputs


def _runs(model_type, class_name):
    """The class built on the tiny config and run eagerly on our example inputs: its output."""
    model, _ = cov.build(model_type, class_name)
    args, kwargs = default_inputs(model)
    with torch.no_grad():
        out = model(*args, **kwargs)
    run_eagerly(model, args, kwargs)
    return model, out


def test_split_to_keeps_proportions_and_total():
    assert split_to([16, 24, 24], 8) == [2, 3, 3]
    assert split_to([24, 20, 20], 8) == [3, 3, 2]
    assert split_to([1, 1, 1], 8) == [3, 3, 2]  # ERNIE-VL's default [22, 22, 20]: h == w kept
    assert split_to([22, 22, 20], 8) == [3, 3, 2]
    assert split_to([8, 12, 12], 4) == [1, 2, 1]
    assert split_to([1, 30], 4) == [1, 3] and split_to([64, 192], 64) == [16, 48]


@pytest.mark.parametrize("model_type, half", [("qwen2_vl", 8), ("glm4v_moe", 4), ("cosmos3_edge", 8),
                                              ("hy_v4_vl", 8)])
def test_mrope_sections_sum_to_half_the_shrunk_rotary_width(model_type, half):
    # Qwen2-VL reads its modeling default [16, 24, 24] (sum 64 = 128 / 2) unless the config
    # states one; GLM-4V-MoE rotates half of each 16-wide head; Cosmos3 and HY-V4 validate it
    cfg, over = cov.tiny_config(model_type)
    text = cfg.get_text_config()
    sec = text.rope_parameters["mrope_section"]
    assert len(sec) == 3 and min(sec) >= 1 and sum(sec) == half
    head = getattr(text, "qk_rope_head_dim", None) or getattr(text, "head_dim", None) \
        or text.hidden_size // text.num_attention_heads
    factor = text.rope_parameters.get("partial_rotary_factor", 1.0)
    assert int(head * factor) // 2 == half


def test_qwen2_vl_runs_eagerly_with_derived_sections():
    model, out = _runs("qwen2_vl", "Qwen2VLForConditionalGeneration")
    assert out.logits.shape[-1] == model.config.get_text_config().vocab_size
    assert torch.isfinite(out.logits).all()


def test_a_failure_only_at_the_shrunk_size_is_ours():
    # BEiT's default config reads one layer and its segmentation head demands four: transformers'
    assert fails_at_default("beit", "BeitForSemanticSegmentation").startswith("ValueError")
    assert transformers_fails("beit", "BeitForSemanticSegmentation", "build", ValueError("x"))
    # a different exception type at the default (there: none at all) is no reproduction
    assert fails_at_default("llama", "LlamaForCausalLM") is None
    assert not transformers_fails("llama", "LlamaForCausalLM", "config", ValueError("x"))
    # an eager failure the default config does not repeat (this one has no line) is ours
    assert not transformers_fails("beit", "BeitForSemanticSegmentation", "eager", ValueError("x"))


def test_denominator_holds_every_row_but_transformers_own_failures():
    ok = {"model_type": "x", "class": "X", "task": "ctc", "traced": True, "sound": True,
          "complete": True, "certificate": 0.0, "error": None}
    fail = {**ok, "traced": False, "sound": None, "complete": None}
    rows = [ok,
            {**fail, "error": {"stage": "config", "type": "E", "message": "m", "transformers_fails": False}},
            {**fail, "error": {"stage": "build", "type": "E", "message": "m", "transformers_fails": True}},
            {**fail, "error": {"stage": "eager", "type": "E", "message": "m", "transformers_fails": False}},
            {**fail, "error": {"stage": "trace", "type": "E", "message": "m"}}]
    c = cov.summarize(rows)["by_task"]["ctc"]
    assert (c["tried"], c["cannot_build"], c["cannot_run"], c["runs"]) == (5, 1, 0, 4)
    assert c["sound_and_complete"] == 1 and c["fraction"] == 0.25
    res = {"header": {"command": "c", "git": {"commit": "abc"}, "machine": {"transformers": "t", "torch": "t",
                                                                             "cores": 2},
                      "jobs": 1, "threads": 1, "timeout_s": 1.0, "mem_gb": 1, "wall_seconds": 1.0, "rule": "r"},
           "summary": cov.summarize(rows), "rows": rows}
    md = cov.markdown(res)
    ours = md.split("## Rows that fail before the analysis")[1].split("## Rows transformers cannot build")[0]
    theirs = md.split("## Rows transformers cannot build")[1].split("## Every family")[0]
    assert ours.count("| x | X | ctc |") == 3 and theirs.count("| x | X | ctc |") == 1
    assert "| build |" in theirs and "| build |" not in ours


@pytest.mark.parametrize("model_type, field, kinds", [
    ("olmo_hybrid", "layer_types", {"linear_attention", "full_attention"}),
    ("neomme", "layer_types", {"sliding_attention", "full_attention"})])
def test_layer_lists_keep_a_layer_of_each_kind_the_validator_needs(model_type, field, kinds):
    # OLMo-Hybrid and NeoMME validate an attention layer among the others; the first two
    # layers of each are of one kind
    from transformers import CONFIG_MAPPING
    default = getattr(CONFIG_MAPPING[model_type](), field)
    assert len(set(default[:2])) == 1 and set(default) == kinds
    with pytest.raises(Exception, match="full_attention|attention layer"):
        cov.tiny_config(model_type, kinds=False)
    cfg, _ = cov.tiny_config(model_type)
    assert set(getattr(cfg, field)) == kinds and len(getattr(cfg, field)) == cfg.num_hidden_layers == 2


def test_first_layers_where_they_validate():
    # Gemma 3 and Qwen3.5 validate their first layers (all sliding, all linear): kept
    for model_type, kind in (("gemma3_text", "sliding_attention"), ("qwen3_5_text", "linear_attention")):
        cfg, over = cov.tiny_config(model_type)
        assert list(cfg.layer_types) == list(over["layer_types"]) == [kind] * 2


def test_per_layer_head_counts_follow_the_kept_layers():
    # Laguna validates len(num_attention_heads_per_layer) == num_hidden_layers
    cfg, _ = cov.tiny_config("laguna")
    assert list(cfg.num_attention_heads_per_layer) == [4, 4] and cfg.num_hidden_layers == 2
    assert len(cfg.mlp_layer_types) == 2


def test_state_width_stated_beside_expand():
    # Falcon-H1: mamba_d_head × mamba_n_heads == mamba_d_ssm (shrunk as a width)
    cfg, _ = cov.tiny_config("falcon_h1")
    assert cfg.mamba_d_head * cfg.mamba_n_heads == cfg.mamba_d_ssm == 16
    model, out = _runs("falcon_h1", "FalconH1ForCausalLM")
    assert out.logits.shape[-1] == model.config.vocab_size and torch.isfinite(out.logits).all()


def test_fewest_layers_hold_every_kind():
    # Kimi-Linear: three linear layers then a full one; the first layer is dense, the others
    # sparse: the full (and sparse) layer covers both lists' missing kinds, two layers in all
    cfg, _ = cov.tiny_config("kimi_linear", kinds=True)
    assert cfg.num_hidden_layers == 2
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    assert set(cfg.mlp_layer_types) == {"dense", "sparse"}


def test_qualified_counts_partitioning_the_layers_set_their_number():
    # Dory validates n_input + n_recurrent + n_output == num_hidden_layers (8 + 20 + 8 = 36)
    cfg, _ = cov.tiny_config("dory")
    assert (cfg.n_input_layers, cfg.n_recurrent_layers, cfg.n_output_layers) == (1, 1, 1)
    assert cfg.num_hidden_layers == 3 == len(cfg.layer_types)


def test_a_repeated_pattern_of_layer_kinds_spells_the_new_layers():
    # GPT-Neo validates len(attention_layers) == num_layers; attention_types repeats a pair
    cfg, over = cov.tiny_config("gpt_neo")
    assert over["attention_types"] == [[["global", "local"], 1]]
    assert cfg.attention_layers == ["global", "local"] and cfg.num_layers == 2


def test_parts_of_the_width_and_sizes_equal_to_it():
    # Reformer: axial position embedding widths sum to hidden_size (64 + 192 = 256 -> 64)
    cfg, _ = cov.tiny_config("reformer")
    assert sum(cfg.axial_pos_embds_dim) == cfg.hidden_size == 64
    assert list(cfg.axial_pos_embds_dim) == [16, 48]
    # Dots3: the audio adapter's input is its width; the vision adapter's output the text width
    cfg, _ = cov.tiny_config("dots3_note")
    assert cfg.audio_config.adapter_input_size == cfg.audio_config.hidden_size == 64
    assert cfg.vision_config.adapter_out_dim == cfg.text_config.hidden_size == 64
    _runs("reformer", "ReformerForMaskedLM")


def test_qsa_fields_left_none_stay_none():
    # Qwen4-exp: the indexer's fields are all set or all None (none by default): a kv head count
    # left None is filled only for the level's own num_... count
    cfg, _ = cov.tiny_config("qwen4_exp_text")
    assert cfg.indexer_kv_heads is None and cfg.indexer_n_heads is None


@pytest.mark.parametrize("model_type, class_name", [("swin", "SwinForImageClassification"),
                                                    ("donut-swin", "DonutSwinForImageClassification")])
def test_window_no_larger_than_the_last_stage(model_type, class_name):
    # Swin: 64-pixel image, 4-pixel patches, 4 stages: 16, 8, 4, 2 patches a side; window 7 -> 2
    cfg, _ = cov.tiny_config(model_type)
    assert cfg.window_size == cfg.image_size // cfg.patch_size // 2 ** (len(cfg.depths) - 1) == 2
    model, out = _runs(model_type, class_name)
    assert out.logits.shape == (out.logits.shape[0], model.config.num_labels)


def test_a_head_width_summing_two_named_within_it():
    # LongCat-Flash declares qk_head_dim = qk_nope_head_dim + qk_rope_head_dim (128 + 64)
    cfg, _ = cov.tiny_config("longcat_flash")
    assert cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim == 32
    # a plain head_dim is no sum (Qwen3.5's 256 = 128 + 128 linear key and value widths)
    assert cov.tiny_config("qwen3_5_text")[0].head_dim == 16
    model, out = _runs("longcat_flash", "LongcatFlashForCausalLM")
    assert out.logits.shape[-1] == model.config.vocab_size and torch.isfinite(out.logits).all()


def test_heads_within_a_key_value_group_stay_within_the_shrunk_group():
    """Kolibri 1.1 scores keys with ``index_num_heads`` leading query heads of key head 0, which
    its validator bounds by the query heads per key/value head (12 <= 48 / 4 by default): shrunk
    to 4 query heads over 2 key/value heads, at most 2; a heads field the default leaves above
    the group size is not one of these (the main count itself: 4)."""
    from benchmarks.coverage.consistent import group_heads
    from benchmarks.coverage.shrink import role
    cfg, _ = cov.tiny_config("kolibri1_1")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_num_heads) == (4, 2, 2)
    fields = {"num_attention_heads": 48, "num_key_value_heads": 4, "index_num_heads": 12, "n_heads_other": 24}
    out = {"num_attention_heads": 4, "num_key_value_heads": 2, "index_num_heads": 4, "n_heads_other": 4}
    assert group_heads(fields, out, role) == {"index_num_heads": 2}
    model, out = _runs("kolibri1_1", "Kolibri1_1ForCausalLM")
    assert torch.isfinite(out.logits).all()


def test_another_towers_width_named_in_a_local_one():
    # BLT's local encoder and decoder name the global transformer's width (hidden_size_global)
    cfg, _ = cov.tiny_config("blt")
    assert cfg.encoder_config.hidden_size_global == cfg.decoder_config.hidden_size_global \
        == cfg.global_config.hidden_size == 64
    model, out = _runs("blt", "BltForCausalLM")
    assert torch.isfinite(out.logits).all()



@pytest.mark.parametrize("model_type, cls, field, frames", [
    ("blip-2", "Blip2ForConditionalGeneration", "image_token_index", 1),
    ("instructblip", "InstructBlipForConditionalGeneration", "image_token_index", 1),
    ("instructblipvideo", "InstructBlipVideoForConditionalGeneration", "video_token_index", 2)])
def test_query_tokens_get_an_image_token_of_their_own(model_type, cls, field, frames):
    """transformers' default leaves the token None, where its forward compares the ids with it:
    the shrunk config states one, in the text vocabulary and no other token's id; the example
    text holds one a query (a frame's queries each) and the model runs on it."""
    cfg, overrides = cov.tiny_config(model_type)
    token, text = overrides[field], cfg.get_text_config()
    assert getattr(cfg, field) == token and 0 <= token < text.vocab_size
    assert token not in {text.pad_token_id, text.bos_token_id, text.eos_token_id}
    model, _ = cov.build(model_type, cls)
    args, kwargs = default_inputs(model)
    counts = (kwargs["input_ids"] == token).sum(1).tolist()
    assert counts == [cfg.num_query_tokens * frames] * 2
    run_eagerly(model, args, kwargs)


def test_sliding_window_stated_where_sliding_attention_is_named():
    cfg, overrides = cov.tiny_config("step3p7")
    assert overrides["text_config"]["sliding_window"] == 16 == cfg.get_text_config().sliding_window
    _runs("step3p7", "Step3p7ForConditionalGeneration")
    cfg, overrides = cov.tiny_config("qwen2_vl")  # use_sliding_window=False names no sliding attention
    assert cfg.get_text_config().sliding_window is None


def test_feature_layers_within_the_shrunk_vision_tower():
    cfg, overrides = cov.tiny_config("vipllava")
    layers = cfg.vision_config.num_hidden_layers
    assert list(overrides["vision_feature_layer"]) == [-2, -3, -3, -3, 2]  # five kept, in range
    assert all(-(layers + 1) <= i <= layers for i in cfg.vision_feature_layer)
    model, out = _runs("vipllava", "VipLlavaForConditionalGeneration")
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("model_type, cls", [("llava_next", "LlavaNextForConditionalGeneration"),
                                             ("llava_next_video", "LlavaNextVideoForConditionalGeneration")])
def test_grid_pinpoints_are_multiples_of_the_shrunk_image(model_type, cls):
    cfg, overrides = cov.tiny_config(model_type)
    assert overrides["image_grid_pinpoints"] == [[64, 128], [128, 64], [128, 128], [192, 64], [64, 192]]
    model, _ = cov.build(model_type, cls)
    args, kwargs = default_inputs(model)
    # the model's own processor tiles a 64-pixel image at 64 x 128: two tiles and the overview
    assert kwargs["pixel_values"].shape == (2, 3, 3, 64, 64)
    assert kwargs["image_sizes"].tolist() == [[64, 64]] * 2
    run_eagerly(model, args, kwargs)


def test_a_masked_lm_without_a_pad_token_counts_positions_from_one():
    """ESM's default config states no pad token, from which its masked LM counts positions."""
    model, out = _runs("esm", "EsmForMaskedLM")
    assert model.config.pad_token_id == model.config.vocab_size - 1
    assert out.logits.shape[-1] == model.config.vocab_size


def test_a_loop_over_layers_stays_inside_the_shrunk_stack():
    """Inkling 2's loop over layers 6..18 of 24, in blocks of 6: with 2 layers it loops over
    layer 1 (a positive start stays positive, an end rounds up), in blocks of 1, so every layer's
    parameters are read (the loop past the stack left them unread)."""
    cfg, _ = cov.tiny_config("inkling2_loop_text")
    assert (cfg.num_hidden_layers, cfg.loop_layer_index_start, cfg.loop_layer_index_end,
            cfg.n_layers_per_attn_res_block) == (2, 1, 2, 1)
    model, out = _runs("inkling2_loop_text", "Inkling2LoopForCausalLM")
    assert out.logits.shape[-1] == 256


def test_composite_classifier_gets_a_pad_token_on_its_text_config():
    """Qwen3.5's classifier reads the pad token of its text config (the composite config has
    none of its own): the tiny model gets the text vocabulary's last id there, and a batch of
    two rows runs."""
    model, overrides = cov.build("qwen3_5", "Qwen3_5ForSequenceClassification")
    text = model.config.get_text_config()
    assert text.pad_token_id == text.vocab_size - 1 == overrides["pad_token_id"]
    _, out = _runs("qwen3_5", "Qwen3_5ForSequenceClassification")
    assert out.logits.shape[0] == 2 and torch.isfinite(out.logits).all()

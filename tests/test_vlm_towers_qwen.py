"""Issue 65: a Qwen-VL-style vision-language model (patches in a grid, ``image_grid_thw``, a
2-D rotary vision tower whose merger writes into the text stream) is analysed with no inputs:
the example inputs read its vision tower (images from its own image processor, as many image
tokens as its own ``get_image_features`` returns), so the tower's classes and the text's are
claimed, and the certificate holds. A config whose tower writes another width than the text's
cannot take an image at all (transformers' own scatter refuses it): nothing is claimed then."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized
from analyze_helpers import certified_mlp

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default", mrope_section=[2, 1, 1]))
TOKENS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=58, vision_end_token_id=59)


def _qwen2_vl():
    cfg = transformers.Qwen2VLConfig(
        text_config=TEXT, vision_config=dict(depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=4,
                                             patch_size=4, spatial_merge_size=2, temporal_patch_size=2), **TOKENS)
    torch.manual_seed(0)
    return randomized(transformers.Qwen2VLForConditionalGeneration(cfg).eval())


def _qwen3_vl(out_hidden_size=32):
    cfg = transformers.Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=24, num_heads=4, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=out_hidden_size,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]), **TOKENS)
    torch.manual_seed(0)
    return randomized(transformers.Qwen3VLForConditionalGeneration(cfg).eval())


def test_qwen2_vl_inputs_read_the_vision_tower():
    m = _qwen2_vl()
    _, kwargs = default_inputs(m)
    grid = kwargs["image_grid_thw"]
    # one image a row, merged 2 × 2: as many image tokens per row as merged patches
    per_row = int(grid[0].prod()) // 4
    assert grid.shape[0] == 2 and (kwargs["input_ids"] == 60).sum(dim=1).tolist() == [per_row] * 2
    assert kwargs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())


def test_qwen2_vl_analysed_without_inputs_claims_tower_and_text():
    m = _qwen2_vl()  # the tower's MLP: embed_dim × mlp_ratio = 64 units
    r = certified_mlp(m, "model.visual.blocks.0.mlp.fc1.weight", "model.visual.blocks.0.mlp.fc2.weight", 64)
    (text_mlp,) = r.group_of("model.language_model.layers.0.mlp.up_proj.weight", 0)
    assert text_mlp.kind == "perm" and text_mlp.size == 40
    assert ("model.language_model.layers.0.mlp.down_proj.weight", 1) in text_mlp.params
    heads = r.group_of("model.visual.blocks.0.attn.proj.weight", 1)
    assert heads and all(g.kind != "identity" for g in heads)


@pytest.mark.slow
def test_qwen3_vl_analysed_without_inputs_claims_tower_and_deepstack():
    m = _qwen3_vl()
    r = certified_mlp(m, "model.visual.blocks.1.mlp.linear_fc1.weight", "model.visual.blocks.1.mlp.linear_fc2.weight",
                      24)
    (text_mlp,) = r.group_of("model.language_model.layers.0.mlp.gate_proj.weight", 0)
    assert text_mlp.kind == "perm" and text_mlp.size == 40


def test_a_tower_writing_another_width_takes_no_image():
    """transformers' default Qwen3-VL states its tower's output (3584) apart from its text (4096):
    no image fits the text, so the inputs are text only and the unread tower fixes every class."""
    m = _qwen3_vl(out_hidden_size=24)
    _, kwargs = default_inputs(m)
    assert "pixel_values" not in kwargs and not (kwargs["input_ids"] == 60).any()
    r = symgraph.analyze(m)
    assert not r.group_of("model.language_model.layers.0.mlp.gate_proj.weight", 0)

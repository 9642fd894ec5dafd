"""Issue 65: ERNIE-4.5-VL's mixture routes image tokens to vision experts by a second modality
mask (``moe_mm_token_type_ids``, beside multimodal RoPE's ``mm_token_type_ids``); the example
inputs mark each token's modality in every forward parameter named so, so the vision experts
are read and claimed when the model is analysed with no inputs."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def _ernie_vl():
    cfg = transformers.Ernie4_5_VLMoeConfig(
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=[32, 16],
                         moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, num_hidden_layers=2,
                         mlp_layer_types=["dense", "sparse"], num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=dict(rope_theta=500000.0, rope_type="default", mrope_section=[3, 3, 2])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=14,
                           spatial_merge_size=2, temporal_merge_size=2),
        image_token_id=58, image_start_token_id=56, image_end_token_id=57, video_token_id=61,
        video_start_token_id=59, video_end_token_id=60)
    torch.manual_seed(0)
    return randomized(transformers.Ernie4_5_VLMoeForConditionalGeneration(cfg).eval())


def test_every_modality_mask_marks_the_image_tokens():
    _, kwargs = default_inputs(_ernie_vl())
    image = (kwargs["input_ids"] == 58).int()
    assert image.sum() > 0
    assert torch.equal(kwargs["mm_token_type_ids"], image) and torch.equal(kwargs["moe_mm_token_type_ids"], image)


@pytest.mark.slow
def test_vision_experts_are_read_and_claimed():
    m = _ernie_vl()
    r = symgraph.analyze(m)
    assert r.certify(m) < 1e-6
    gate = r.group_of("model.language_model.layers.1.mlp.vision_moe.gate.weight", 0)
    assert [(g.kind, g.size) for g in gate] == [("perm", 4)]  # the vision experts, permuted
    (mlp,) = r.group_of("model.vision_tower.blocks.0.mlp.fc1.weight", 0)
    assert mlp.kind == "perm" and mlp.size == 48

"""Issue 65: a vision-language model's example inputs read its vision tower. Images come from the
model's own image processor (sized to the vision config), else from the forward's own inputs
(a grid of patches where it takes ``image_grid_thw``, tiles where it takes
``pixel_attention_mask``); the image tokens per row are what ``get_image_features`` returns."""
from __future__ import annotations

import inspect

import pytest
import torch

import symgraph
from symgraph.passes.image_processing import (configured_processor, image_side, patch_grids,
                                              processed_images, tiles)
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")

TEXT = dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _idefics3():
    cfg = transformers.Idefics3Config(
        text_config=TEXT, image_token_id=60, scale_factor=2,
        vision_config=dict(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8))
    return randomized(transformers.Idefics3ForConditionalGeneration(cfg))


def test_tiles_from_the_models_own_processor_read_the_vision_tower():
    m = _idefics3()
    _, kw = default_inputs(m)
    # Idefics3's processor, sized to the vision config (one 32-pixel tile, no splitting), not its
    # default 364-pixel tiles; (32/8)² patches shuffled by a scale factor of 2: 4 tokens an image
    assert kw["pixel_values"].shape == (2, 1, 3, 32, 32) and kw["pixel_attention_mask"].shape == (2, 1, 32, 32)
    ids = kw["input_ids"]
    assert (ids == 60).sum(1).tolist() == [4, 4] and ids[:, 0].ne(60).all()
    r = symgraph.analyze(m)
    assert r.certify(m) < 1e-6
    (fc,) = r.group_of("model.vision_model.encoder.layers.0.mlp.fc1.weight", 0)
    assert fc.kind == "perm" and fc.size == 20
    assert ("model.vision_model.encoder.layers.0.mlp.fc2.weight", 1) in fc.params


def test_processor_takes_the_vision_configs_patch_merge_and_frames():
    vision = transformers.Qwen2VLConfig(vision_config=dict(patch_size=8, spatial_merge_size=2,
                                                           temporal_patch_size=1)).vision_config
    proc = configured_processor("qwen2_vl", vision)
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (8, 2, 1)
    assert image_side(vision) == 2 * 2 * 8  # no image_size: two merged patches a side
    # Qwen-VL's size bounds are pixel counts, not sides: one merged patch (16²) at least, the
    # image (32²) at most, so it is never enlarged (its default least count is 56²)
    assert (proc.size.shortest_edge, proc.size.longest_edge) == (16 * 16, 32 * 32)


def test_processed_images_keep_only_what_the_forward_takes():
    cfg = transformers.Qwen2VLConfig(vision_config=dict(patch_size=8, spatial_merge_size=2, temporal_patch_size=1,
                                                        depth=1, embed_dim=16, num_heads=4, hidden_size=16))
    model = transformers.Qwen2VLForConditionalGeneration.__new__(transformers.Qwen2VLForConditionalGeneration)
    model.config = cfg
    params = inspect.signature(transformers.Qwen2VLForConditionalGeneration.forward).parameters
    out = processed_images(model, cfg.vision_config, params, 2, torch.Generator().manual_seed(0))
    assert set(out) == {"pixel_values", "image_grid_thw"}
    # a 32-pixel image: 4 × 4 patches of 8
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert out["pixel_values"].shape == (2 * 16, 3 * 8 * 8)
    assert processed_images(model, cfg.vision_config, {"input_ids": None}, 2, torch.Generator()) is None


def test_grids_and_tiles_only_where_the_forward_takes_them():
    vision = transformers.Qwen2VLConfig(vision_config=dict(patch_size=4, spatial_merge_size=2,
                                                           temporal_patch_size=2)).vision_config
    grids = patch_grids(vision, {"pixel_values": None, "image_grid_thw": None}, 3, torch.Generator())
    assert [tuple(g["pixel_values"].shape) for g in grids] == [(48, 96), (48, 3, 4, 4), (1536, 3)]
    assert all(g["image_grid_thw"].tolist() == [[1, 4, 4]] * 3 for g in grids)
    assert patch_grids(vision, {"pixel_values": None}, 3, torch.Generator()) == []
    assert tiles(vision, {"pixel_values": None}, 3, torch.Generator()) == []
    (t,) = tiles(vision, {"pixel_attention_mask": None}, 3, torch.Generator())
    assert t["pixel_values"].shape == (3, 1, 3, 16, 16) and t["pixel_attention_mask"].all()

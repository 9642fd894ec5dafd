"""Issue 65: NaViT-packed image inputs (``target_sizes``: MiniCPM-V's layout) built from the
vision config where transformers' image processor for the model needs torchvision (MiniCPM-OCR):
each row's image a grid of patches, all of them side by side in one strip."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from symgraph.passes.image_processing import packed_patches
from symgraph.passes.inputs import default_inputs

transformers = pytest.importorskip("transformers")


def test_patches_side_by_side_with_each_images_grid():
    vision = SimpleNamespace(patch_size=16, image_size=64, num_channels=3)
    gen = torch.Generator().manual_seed(0)
    small, large = packed_patches(vision, {"target_sizes": None}, 2, gen)
    assert small["pixel_values"].shape == (1, 3, 16, 2 * 4 * 4 * 16)
    assert small["target_sizes"].tolist() == [[4, 4], [4, 4]] and small["target_sizes"].dtype == torch.int32
    assert large["pixel_values"].shape == (1, 3, 16, 2 * 8 * 8 * 16) and large["target_sizes"][0].tolist() == [8, 8]
    # an odd grid is made even (2 × 2 windows and merges)
    (odd, _) = packed_patches(SimpleNamespace(patch_size=16, image_size=48), {"target_sizes": None}, 1, gen)
    assert odd["target_sizes"].tolist() == [[4, 4]]
    assert packed_patches(vision, {"pixel_values": None}, 2, gen) == []  # no target_sizes taken


def test_minicpm_ocr_inputs_take_packed_patches_and_their_tokens():
    cfg = transformers.MiniCPMOcrConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=["full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=16), image_token_id=60, video_token_id=61, insert_layer_id=0)
    torch.manual_seed(0)
    m = transformers.MiniCPMOcrForConditionalGeneration(cfg).eval()
    _, kwargs = default_inputs(m)
    sizes = kwargs["target_sizes"]
    assert sizes.tolist() == [[4, 4], [4, 4]]
    assert kwargs["pixel_values"].shape == (1, 3, 16, 2 * 16 * 16)
    # as many image tokens per row as the tower's features for one image: 4 x 4 patches merged 2 x 2
    assert (kwargs["input_ids"] == 60).sum(dim=1).tolist() == [4, 4]
    with torch.no_grad():
        assert torch.isfinite(m(**kwargs).logits).all()

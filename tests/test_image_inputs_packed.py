"""Issue 65: NaViT-packed image inputs (``target_sizes``: MiniCPM-V's layout) built from the
vision config where transformers' image processor for the model needs torchvision (MiniCPM-OCR):
each row's image a grid of patches, all of them side by side in one strip; a mode of the image
tower that reads more (MiniCPM-OCR's ViT merger) taken."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from symgraph.passes.image_inputs import tower_modes
from symgraph.passes.image_processing import packed_patches
from symgraph.passes.inputs import default_inputs
from symgraph.passes.optional_inputs import Trials

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
    # the config's downsample_mode "4x" skips the ViT merger; "16x", which its docstring names, runs it
    assert cfg.downsample_mode == "4x" and tower_modes(m) == [("downsample_mode", "16x")]
    assert kwargs["downsample_mode"] == "16x"
    # as many image tokens per row as the tower's features for one image: 4 x 4 patches merged
    # 2 x 2 by the ViT merger, then 2 x 2 by the merger
    assert (kwargs["input_ids"] == 60).sum(dim=1).tolist() == [1, 1]
    with torch.no_grad():
        assert torch.isfinite(m(**kwargs).logits).all()
    names = {n for n, _ in m.named_parameters()}
    merger = {n for n in names if ".vit_merger." in n}
    assert merger and Trials(m, {}).reads(kwargs) == names  # every parameter, the ViT merger's too
    without = Trials(m, {}).reads({k: v for k, v in kwargs.items() if k != "downsample_mode"})
    assert without is None or not merger & without  # "4x": refused (tokens for 16x) or merger unread


def test_a_mode_that_reads_nothing_more_is_not_taken():
    """LLaVA's ``vision_feature_select_strategy`` "full" (its docstring's other value) keeps the
    CLS feature, which the default reads too: the inputs stay without it."""
    cfg = transformers.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8), image_token_index=60)
    torch.manual_seed(0)
    m = transformers.LlavaForConditionalGeneration(cfg).eval()
    assert tower_modes(m) == [("vision_feature_select_strategy", "full")]
    _, kwargs = default_inputs(m)
    assert "vision_feature_select_strategy" not in kwargs
    assert (kwargs["input_ids"] == 60).sum(dim=1).tolist() == [16, 16]  # 4 x 4 patches, CLS dropped

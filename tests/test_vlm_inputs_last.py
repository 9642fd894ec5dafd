"""Issue 65, the last vision-language rows: a tower whose grid states rows and columns only
(``image_grid_hw``: RADIO's in Nemotron-H Omni) gets flattened patches and that grid, so its
images are read; its videos share the image token (a forward that reads images cannot also read
videos: their placeholders are counted against the images' features), so the video patch
projection is the one parameter left unread."""
from __future__ import annotations

import warnings

import pytest
import torch

from symgraph.passes.image_processing import patch_grids
from symgraph.passes.inputs import default_inputs
from symgraph.passes.optional_inputs import Trials

T = pytest.importorskip("transformers")


def test_row_column_grid_without_frames():
    """Where the forward takes ``image_grid_hw`` (and no ``image_grid_thw``), each candidate is
    the frame grid's rows and columns: ``2·merge × 2·merge`` patches a row, no frames column."""
    vision = T.PretrainedConfig(patch_size=4, num_channels=3)
    cands = patch_grids(vision, {"image_grid_hw": None, "pixel_values": None}, 2, torch.Generator().manual_seed(0))
    assert [tuple(c["pixel_values"].shape) for c in cands] == [(8, 48), (8, 3, 4, 4), (128, 3)]
    assert all(set(c) == {"pixel_values", "image_grid_hw"} for c in cands)
    assert all(c["image_grid_hw"].tolist() == [[2, 2], [2, 2]] for c in cands)
    thw = patch_grids(vision, {"image_grid_thw": None}, 2, torch.Generator().manual_seed(0))
    assert thw[0]["image_grid_thw"].tolist() == [[1, 2, 2]] * 2  # the three-column grid unchanged


def test_nemotron_h_omni_reads_its_image_tower():
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("nemotron_h_omni", "NemotronH_Omni_Reasoning_V3")
    _, kw = default_inputs(m)
    v = m.config.vision_config
    assert kw["image_grid_hw"].tolist() == [[2, 2], [2, 2]]
    assert tuple(kw["pixel_values"].shape) == (8, v.num_channels * v.patch_size ** 2)
    assert ((kw["input_ids"] == m.config.image_token_id).sum(1) == 1).all()  # 2 × 2 patches: one token
    read = Trials(m, {}).reads(kw)
    assert read is not None
    assert {n for n, _ in m.named_parameters()} - read == {"vision_model.embeddings.video_patch_projection.weight"}

"""Issue 65: Nemotron-H Omni's video tower through the example inputs. Its ``pixel_values`` are
packed patches with a grid (``image_grid_hw``), not 4-D images, and its videos are tubelets
(``pixel_values_videos`` of the documented shape ``(num_videos, num_tubelets,
video_temporal_patch_size * num_channels, height, width)``) embedded by their own projection
(``video_patch_projection``), which no image reads: the examples build one tubelet a row, and
its features go on the image tokens (the forward's video placeholders are the image token's)."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.passes.optional_inputs import Trials

transformers = pytest.importorskip("transformers")
IMAGE, VIDEO = 60, 61


@pytest.fixture(scope="module")
def omni():
    cfg = transformers.AutoConfig.for_model(
        "nemotron_h_omni",
        text_config=dict(vocab_size=64, hidden_size=32, layers_block_type=["full_attention", "mlp"],
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, patch_size=16,
                           image_size=64, video_temporal_patch_size=2, num_cls_tokens=3, num_registers=1),
        vision_hidden_size=32, projector_hidden_size=32, image_token_id=IMAGE, video_token_id=VIDEO)
    torch.manual_seed(0)
    m = transformers.NemotronH_Omni_Reasoning_V3(cfg).float().eval()
    return m, default_inputs(m)[1]


def test_one_tubelet_a_row_on_the_image_tokens(omni):
    m, kw = omni
    grid = kw["image_grid_hw"]
    assert kw["pixel_values"].dim() == 2 and grid.shape == (2, 2)
    side = (int(grid[0, 0]) * 16, int(grid[0, 1]) * 16)
    assert tuple(kw["pixel_values_videos"].shape) == (2, 1, 2 * 3, *side)  # 2 frames x 3 channels
    ids = kw["input_ids"]
    assert not (ids == VIDEO).any()  # the forward reads no video token
    tokens = (ids == IMAGE).sum(1)
    assert (tokens == grid.prod(-1) // 4).all()  # the grid, pixel-shuffled 2 x 2
    with torch.no_grad():
        feats = m.get_video_features(kw["pixel_values_videos"]).pooler_output
    assert [len(f) for f in feats] == tokens.tolist()
    names = {n for n, _ in m.named_parameters()}
    assert Trials(m, {}).reads(kw) == names  # the video's projection too
    without = Trials(m, {}).reads({k: v for k, v in kw.items() if k != "pixel_values_videos"})
    assert names - without == {"vision_model.embeddings.video_patch_projection.weight"}


@pytest.mark.slow
def test_classes_of_both_towers_certified_on_each(omni):
    """The analysis claims the vision tower's classes (both patch projections move with them),
    the projector's and the text's; the certificate holds on the examples and on each
    modality alone: on the examples the videos' features overwrite the images', so the images'
    own projection is judged on the images alone."""
    m, kw = omni
    rep = symgraph.analyze(m)
    kinds = {g.kind for g in rep.groups}
    assert {"perm", "gl"} <= kinds
    stream = rep.group_of("vision_model.embeddings.video_patch_projection.weight", 0)
    assert stream and stream == rep.group_of("vision_model.embeddings.patch_projection.weight", 0)
    assert rep.group_of("vision_model.encoder.layer.0.mlp.fc1.weight", 0)
    assert rep.group_of("multi_modal_projector.linear_1.weight", 0)
    assert rep.group_of("language_model.model.layers.1.mixer.up_proj.weight", 0)
    assert rep.certify(m) <= 1e-6
    images = {k: v for k, v in kw.items() if k != "pixel_values_videos"}
    videos = {k: v for k, v in kw.items() if k not in ("pixel_values", "image_grid_hw")}
    assert rep.certify(m, inputs=images) <= 1e-6
    assert rep.certify(m, inputs=videos) <= 1e-6
    # the images' projection is read, but on the examples no output depends on it
    w = m.vision_model.embeddings.patch_projection.weight
    with torch.no_grad():
        before = m(**kw).logits
        saved = w.clone()
        w.add_(1.0)
        after = m(**kw).logits
        w.copy_(saved)
    assert torch.equal(before, after)

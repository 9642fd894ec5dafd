"""Issue 65, the last vision-language rows: a tower whose grid states rows and columns only
(``image_grid_hw``: RADIO's in Nemotron-H Omni) gets flattened patches and that grid, so its
images are read; its videos share the image token, so one tubelet a row with as many features
as an image's goes on the image tokens and the video patch projection is read too
(tests/test_image_inputs_video.py). Inkling's discrete audio (``audio_input_ids``:
frames of one code per codebook) and its images (each patch its own clip of
``temporal_patch_size`` frames, channels last, one text token each) are both read. NeoMME's patches (a flat list of ``3·P·P``-wide patches,
embedded to its hidden width past its factorised token embeddings) are counted and read."""
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
    assert {n for n, _ in m.named_parameters()} - read == set()
    assert tuple(kw["pixel_values_videos"].shape) == (2, 1, 2 * v.num_channels, 2 * v.patch_size, 2 * v.patch_size)


def test_inkling_reads_its_audio_codes_and_its_patch_clips():
    import symgraph
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("inkling_mm_model", "InklingForConditionalGeneration")
    a, v = m.config.audio_config, m.config.vision_config
    _, kw = default_inputs(m)
    codes = kw["audio_input_ids"]
    assert tuple(codes.shape) == (2, 8, a.num_codebooks) and 0 <= int(codes.min()) and int(codes.max()) < a.codebook_size
    assert tuple(kw["pixel_values"].shape) == (8, v.temporal_patch_size, v.patch_size, v.patch_size, v.num_channels)
    ids = kw["input_ids"]
    assert ((ids == m.config.audio_token_id).sum(1) == 8).all() and ((ids == m.config.image_token_id).sum(1) == 4).all()
    read = Trials(m, {}).reads(kw)
    assert read is not None and {n for n, _ in m.named_parameters()} - read == set()
    rep = symgraph.analyze(m)  # no inputs
    assert rep.certify(m) <= 1e-6
    emb = [g for g in rep.groups if ("model.audio_tower.embed_audio_tokens.embed_audio_tokens.weight", 1)
           in [tuple(p) for p in g.params]]
    assert emb and emb[0].size == m.config.text_config.hidden_size and emb[0].kind == "perm"  # the residual stream


def test_neomme_reads_its_flat_patches():
    """NeoMME's token embeddings are factorised (``embedding_rank`` wide), its patch features
    ``hidden_size`` wide: the features are counted by the text's width, and the rows of patches
    its placeholders cannot take are refused for one flat list of ``batch × n`` patches."""
    import symgraph
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("neomme", "NeoMMEForMaskedLM")
    c = m.config
    assert m.get_input_embeddings().embedding_dim != c.hidden_size
    _, kw = default_inputs(m)
    n = (c.image_size // c.patch_size) ** 2 if getattr(c, "image_size", None) else None
    px, ids = kw["pixel_values"], kw["input_ids"]
    assert px.dim() == 2 and px.shape[1] == c.patch_dim
    assert int((ids == c.image_token_id).sum()) == px.shape[0] and ((ids == c.image_token_id).sum(1) == px.shape[0] // 2).all()
    assert n is None or px.shape[0] == 2 * n
    read = Trials(m, {}).reads(kw)
    assert read is not None and {n for n, _ in m.named_parameters()} - read == set()
    rep = symgraph.analyze(m)
    assert rep.certify(m) <= 1e-6
    up = [g for g in rep.groups if ("model.patch_embeddings.up_proj.weight", 0) in [tuple(p) for p in g.params]]
    assert up and up[0].kind == "perm" and up[0].size == 2 * c.hidden_size  # the patch stem's hidden units

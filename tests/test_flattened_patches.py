"""Issue 65: Pix2Struct-style flattened patches (``flattened_patches``: each patch's row and
column, then its ``C·P·P`` pixels) as example inputs (symgraph/passes/patch_inputs.py), and the
shrink rules that keep a config's patch width and query tokens consistent
(benchmarks/coverage/consistent.py):

- the patch side comes from the vision config's patch embedding width (``patch_embed_hidden_size``
  = ``C·P·P``); the patches are what transformers' own image processor makes (a 4 × 4 grid), or
  the same layout by hand for a model type it names no processor for;
- Pix2Struct takes them as its main input, Kosmos-2.5 beside its text, with as many image
  positions (``image_embeds_position_mask``) as its ``get_image_features`` returns: every
  parameter is read, so the towers' classes are claimed and certify;
- the shrink keeps ``patch_embed_hidden_size`` the processor's 3 × 16 × 16 = 768 (it equalled
  Pix2Struct's width, so it was scaled to 64, which no patch fits) and bounds Kosmos-2.5's 2048
  learned queries to 64.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.passes.patch_inputs import flattened_patches, patch_side
from analyze_helpers import unread

T = pytest.importorskip("transformers")

GRID = [[r, c] for r in range(1, 5) for c in range(1, 5)]  # a 4 × 4 grid, numbered from 1


def _vision(**kw):
    return dict(hidden_size=32, patch_embed_hidden_size=48, num_hidden_layers=1, num_attention_heads=4, **kw)


def _pix2struct():
    cfg = T.Pix2StructConfig(
        text_config=dict(vocab_size=64, hidden_size=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
        vision_config=_vision(d_ff=64, d_kv=8, seq_len=64))
    torch.manual_seed(0)
    return T.Pix2StructForConditionalGeneration(cfg).eval()


def _kosmos25(queries=4):
    cfg = T.Kosmos2_5Config(
        text_config=dict(vocab_size=64, embed_dim=32, layers=1, ffn_dim=64, attention_heads=4,
                         max_position_embeddings=64),
        vision_config=_vision(intermediate_size=64, head_dim=8, max_num_patches=64), latent_query_num=queries)
    torch.manual_seed(0)
    return T.Kosmos2_5ForConditionalGeneration(cfg).eval()


def _kinds(rep, slot):
    return sorted(g.kind for g in rep.groups if slot in [tuple(p) for p in g.params])


@pytest.mark.parametrize("width, channels, side", [(768, 3, 16), (48, 3, 4), (16, 1, 4), (64, 3, None),
                                                   (96, 3, None)])
def test_patch_side_from_the_patch_embedding_width(width, channels, side):
    vision = T.Pix2StructVisionConfig(patch_embed_hidden_size=width)
    vision.num_channels = channels
    assert patch_side(vision) == side


def test_processor_patches_and_the_layout_by_hand_agree():
    """Pix2Struct's processor makes 16 patches of 2 + 3·4·4 values, rows and columns first; a
    vision model whose type names no processor gets the same grid by hand."""
    model = _pix2struct()
    made = flattened_patches(model, model.config.vision_config, 2, torch.Generator().manual_seed(0))
    assert made is not None and tuple(made.shape) == (2, 16, 50)
    assert made[0, :, :2].tolist() == GRID and made[1, :, :2].tolist() == GRID
    assert made[:, :, 2:].std() > 0.5  # normalised pixels, not zeros
    torch.manual_seed(0)
    tower = T.Pix2StructVisionModel(T.Pix2StructVisionConfig(**_vision(d_ff=64, d_kv=8, seq_len=64))).eval()
    hand = flattened_patches(tower, tower.config, 2, torch.Generator().manual_seed(0))
    assert hand is not None and tuple(hand.shape) == (2, 16, 50) and hand[1, :, :2].tolist() == GRID
    assert flattened_patches(tower, T.Pix2StructVisionConfig(patch_embed_hidden_size=64), 2,
                             torch.Generator()) is None  # 64 is no 3·P·P


def test_pix2struct_main_input_reads_every_parameter_and_certifies():
    model = _pix2struct()
    _, kwargs = default_inputs(model)
    assert tuple(kwargs["flattened_patches"].shape) == (2, 16, 50)
    assert kwargs["decoder_input_ids"][:, 0].tolist() == [0, 0]
    assert unread(model, kwargs) == set()
    rep = symgraph.analyze(model)
    assert rep.unread is None
    assert _kinds(rep, ("encoder.embeddings.patch_projection.weight", 0)) == ["perm"]  # the tower's stream
    assert _kinds(rep, ("encoder.encoder.layer.0.attention.query.weight", 0)) == ["gl", "perm"]  # heads
    assert _kinds(rep, ("encoder.encoder.layer.0.mlp.wi_0.weight", 0)) == ["perm"]
    assert rep.certify(model) <= 1e-6


def test_kosmos25_patches_beside_text_one_position_per_query():
    model = _kosmos25()
    _, kwargs = default_inputs(model)
    ids, mask = kwargs["input_ids"], kwargs["image_embeds_position_mask"]
    assert tuple(kwargs["flattened_patches"].shape) == (2, 16, 50)
    assert ids.shape == mask.shape == (2, 12)
    assert mask.sum(1).tolist() == [4, 4] and mask[:, 1:5].eq(1).all() and mask[:, 0].eq(0).all()
    assert unread(model, kwargs) == set()
    rep = symgraph.analyze(model)
    assert rep.unread is None
    assert _kinds(rep, ("vision_model.encoder.layer.0.attention.query.weight", 0)) == ["gl", "perm"]
    assert _kinds(rep, ("text_model.model.layers.0.self_attn.q_proj.weight", 0)) == ["gl", "perm"]
    assert _kinds(rep, ("image_to_text_projection.x_attn.q_proj.weight", 0)) == ["gl", "perm"]
    assert rep.certify(model) <= 1e-6


def test_kosmos25_text_too_short_for_its_queries_goes_without_images():
    """More learned queries than the text has positions: no patches, no mask (never ids past
    the position table)."""
    model = _kosmos25(queries=60)
    _, kwargs = default_inputs(model)
    assert "flattened_patches" not in kwargs and "image_embeds_position_mask" not in kwargs
    assert kwargs["input_ids"].shape == (2, 8)


def _tiny(model_type):
    from benchmarks.coverage.shrink import tiny_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config(model_type)[1]


def test_shrink_keeps_the_patch_width_and_bounds_the_queries():
    pix = _tiny("pix2struct")["vision_config"]
    assert pix["hidden_size"] == 64 and pix["patch_embed_hidden_size"] == 768 == 3 * 16 * 16
    assert _tiny("pix2struct_vision_model")["patch_embed_hidden_size"] == 768
    kosmos = _tiny("kosmos-2.5")
    assert kosmos["latent_query_num"] == 64 and kosmos["vision_config"]["patch_embed_hidden_size"] == 768
    assert "latent_query_num" not in _tiny("kosmos-2")  # its 64 is kept as it is
    assert "num_query_tokens" not in _tiny("blip-2")  # 32


def test_patch_pixels_rule_keeps_only_a_patchs_pixel_count():
    from benchmarks.coverage.consistent import patch_pixels
    from benchmarks.coverage.derived import query_tokens
    fields = {"patch_embed_hidden_size": 768, "hidden_size": 768}
    assert patch_pixels(fields, {"patch_embed_hidden_size": 64}) == {"patch_embed_hidden_size": 768}
    assert patch_pixels(fields, {}) == {}  # unchanged: nothing to keep
    assert patch_pixels({"patch_embed_hidden_size": 1000}, {"patch_embed_hidden_size": 64}) == {}  # no 3·P·P
    assert patch_pixels({"patch_embed_hidden_size": 256, "num_channels": 1},
                        {"patch_embed_hidden_size": 64}) == {"patch_embed_hidden_size": 256}
    assert query_tokens({"latent_query_num": 2048, "num_query_tokens": 32}) == {"latent_query_num": 64}

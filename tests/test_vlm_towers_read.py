"""Issue 65, vision-language rows whose tower the example inputs left unread or whose inputs
failed (a parameter the traced program never reads fixes every class, so such a model claimed
nothing):

- a projector that pools an image's patches into learned queries, as many as a map from patch
  counts states (Aria's ``projector_patch_to_query_dict``): the shrink rule keys that map by the
  shrunk image's patch count, so the images the examples build at the vision config's size reach
  the tower, as a real checkpoint's images of its own size do;
- Molmo2: its image token is stored as ``image_patch_id`` (the config's ``attribute_map``), which
  the shrink rule now renumbers into the vocabulary and the example text avoids; its processor
  needs torchvision, so its images are laid out as that processor lays them: one crop of patches a
  row, each image token pooling a block of patches (``image_token_pooling``, ``image_grids``).
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from analyze_helpers import coverage_row, unread

pytest.importorskip("transformers")


def test_patch_query_map_keyed_by_the_shrunk_patch_count():
    from benchmarks.coverage.derived import patch_queries
    fields = {"projector_patch_to_query_dict": {1225: 128, 4900: 256}, "vocab_size": 10}
    out = {"vision_config": {"image_size": 64, "patch_size": 32}}
    assert patch_queries(fields, out) == {"projector_patch_to_query_dict": {4: 4}}
    out14 = {"vision_config": {"image_size": 64, "patch_size": 14}}  # 4 × 4 patches: 16 queries
    assert patch_queries(fields, out14) == {"projector_patch_to_query_dict": {16: 16}}
    stated = {"projector_patch_to_query_dict": {"4": 2}}  # a count the image has (JSON keys): kept
    assert patch_queries(stated, out) == {}
    assert patch_queries(fields, {}) == {}  # no vision config: nothing to key by


def test_aria_reads_its_vision_tower():
    """Aria's shrunk projector takes the 2 × 2 patches of a 64-pixel image of 32-pixel patches:
    the examples hold that image and 4 image tokens a row, every parameter is read, and the
    analysis (no inputs) claims the vision tower's and the text's classes, soundly."""
    m = coverage_row("aria", "AriaForConditionalGeneration")
    v = m.config.vision_config
    assert m.config.projector_patch_to_query_dict == {(v.image_size // v.patch_size) ** 2: 4}
    _, kw = default_inputs(m)
    assert tuple(kw["pixel_values"].shape) == (2, v.num_channels, v.image_size, v.image_size)
    assert ((kw["input_ids"] == m.config.image_token_id).sum(1) == 4).all()
    assert unread(m, kw) == set()
    rep = symgraph.analyze(m)
    slots = {p for g in rep.groups for p, *_ in g.params}
    assert any(p.startswith("model.vision_tower.") for p in slots)
    assert any(p.startswith("model.multi_modal_projector.") for p in slots)
    assert any(p.startswith("model.language_model.layers.") for p in slots)
    assert rep.certify(m) <= 1e-6


def test_an_aliased_token_id_is_renumbered_into_the_vocabulary():
    from benchmarks.coverage.derived import aliased_token_ids

    class Cfg:
        attribute_map = {"image_token_id": "image_patch_id", "video_token_id": "image_patch_id",
                         "hidden_dim": "hidden_size", "pad_token_index": "pad_token_id"}
    fields = {"image_patch_id": 151938, "hidden_size": 4096, "pad_token_id": 0}
    assert aliased_token_ids(Cfg(), fields, 249) == {"image_patch_id": 249}
    assert aliased_token_ids(Cfg(), {"image_patch_id": 7}, 249) == {}  # within the vocabulary: kept
    assert aliased_token_ids(None, fields, 249) == {}


def test_pooled_patches_index_one_crop_a_row():
    from symgraph.passes.tower_inputs import pooled_patches
    vision = type("V", (), {"patch_size": 14, "image_size": [378, 378], "num_channels": 3})()
    gen = torch.Generator().manual_seed(0)
    assert pooled_patches(vision, {"pixel_values": None}, 2, gen) == []  # not the forward's inputs
    (images,) = pooled_patches(vision, {"image_token_pooling": None, "image_grids": None}, 2, gen)
    assert tuple(images["pixel_values"].shape) == (2, 27 * 27, 3 * 14 * 14)
    pool = images["image_token_pooling"]
    assert tuple(pool.shape) == (8, 4) and images["image_grids"].tolist() == [[2, 2, 0, 0]] * 2
    assert pool[:4].max() < 27 * 27 <= pool[4:].min() and len(set(pool.flatten().tolist())) == 32
    assert pool[0].tolist() == [0, 1, 27, 28]  # a 2 × 2 block of patches
    assert "image_num_crops" not in images
    # a forward that takes each image's crop count (transformers ≥ 5.25) indexes each image's own
    # patches and adds the offsets itself
    (own,) = pooled_patches(vision, {"image_token_pooling": None, "image_grids": None,
                                     "image_num_crops": None}, 2, gen)
    assert own["image_num_crops"].tolist() == [1, 1]
    assert torch.equal(own["image_token_pooling"][:4], own["image_token_pooling"][4:])
    assert torch.equal(own["image_token_pooling"][4:] + 27 * 27, pool[4:])


def test_molmo2_reads_its_vision_tower_and_adapter():
    m = coverage_row("molmo2", "Molmo2ForConditionalGeneration")
    cfg = m.config
    token = cfg.image_token_id
    assert token == cfg.image_patch_id < cfg.text_config.vocab_size + cfg.text_config.additional_vocab_size
    assert token not in {cfg.image_start_token_id, cfg.image_end_token_id, cfg.low_res_image_start_token_id}
    _, kw = default_inputs(m)
    assert tuple(kw["pixel_values"].shape) == (2, 27 * 27, 3 * 14 * 14)
    assert ((kw["input_ids"] == token).sum(1) == 4).all()  # the 2 × 2 pooled tokens, none else
    assert torch.equal(kw["mm_token_type_ids"], (kw["input_ids"] == token).int())
    assert unread(m, kw) == set()
    rep = symgraph.analyze(m)
    slots = {p for g in rep.groups for p, *_ in g.params}
    for tower in ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."):
        assert any(p.startswith(tower) for p in slots), tower
    assert rep.certify(m) <= 1e-6


def test_ovis2_5_reads_its_image_between_boundary_tokens():
    """Ovis 2.5 counts one image start and one image end token per image (its processor writes
    them) and adds its learned visual indicators there: the example inputs put each row's image
    tokens between the two, and every parameter is read."""
    m = coverage_row("ovis2_5", "Ovis2_5ForConditionalGeneration")
    cfg = m.config
    _, kw = default_inputs(m)
    ids = kw["input_ids"]
    for row in ids.tolist():
        image = [i for i, t in enumerate(row) if t == cfg.image_token_id]
        assert image == list(range(image[0], image[-1] + 1)) and len(image) > 1
        assert row.count(cfg.image_start_token_id) == row.count(cfg.image_end_token_id) == 1
        assert row[image[0] - 1] == cfg.image_start_token_id and row[image[-1] + 1] == cfg.image_end_token_id
    assert unread(m, kw) == set()
    rep = symgraph.analyze(m)
    assert rep.certify(m) <= 1e-6 and not rep.unread


def test_a_model_returning_its_prefix_cache_is_traced_without_it():
    """PI0.5 prefills its prefix with ``use_cache=True`` hard-coded and returns the cache, which
    no exported program holds: the trace leaves the cache out of the output (it is state for
    ``generate``, not an output); the program's outputs are the model's tensors, certified."""
    from transformers.cache_utils import Cache

    from symgraph.passes.output_caches import caches_dropped
    from symgraph.passes.trace import flatten_outputs
    m = coverage_row("pi05", "PI05ForConditionalGeneration")
    args, kw = default_inputs(m)
    with torch.no_grad():
        out = m(*args, **kw)
        assert any(isinstance(v, Cache) for v in out.values())
        with caches_dropped(m):
            kept = m(*args, **kw)
    assert "forward" not in vars(m)  # the class's forward again
    assert not any(isinstance(v, Cache) for v in kept.values()) and list(kept) == [k for k in out if k != "cache"]
    assert all(torch.equal(a, b) for a, b in zip(flatten_outputs(out), flatten_outputs(kept)))
    rep = symgraph.analyze(m)
    assert len(rep.exported_program.graph_signature.user_outputs) == len(flatten_outputs(out))
    assert rep.certify(m) <= 1e-6 and not rep.unread

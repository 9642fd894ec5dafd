"""Issue 65, vision-language rows whose tower the example inputs left unread or whose inputs
failed (a parameter the traced program never reads fixes every class, so such a model claimed
nothing):

- a projector that pools an image's patches into learned queries, as many as a map from patch
  counts states (Aria's ``projector_patch_to_query_dict``): the shrink rule keys that map by the
  shrunk image's patch count, so the images the examples build at the vision config's size reach
  the tower, as a real checkpoint's images of its own size do.
"""
from __future__ import annotations

import warnings

import pytest

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.passes.optional_inputs import Trials

pytest.importorskip("transformers")


def _build(model_type, class_name):
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(model_type, class_name)[0]


def _unread(model, kwargs):
    read = Trials(model, {}).reads(kwargs)
    assert read is not None
    return {n for n, _ in model.named_parameters()} - read


def test_patch_query_map_keyed_by_the_shrunk_patch_count():
    from benchmarks.coverage.tower_sizes import patch_queries
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
    m = _build("aria", "AriaForConditionalGeneration")
    v = m.config.vision_config
    assert m.config.projector_patch_to_query_dict == {(v.image_size // v.patch_size) ** 2: 4}
    _, kw = default_inputs(m)
    assert tuple(kw["pixel_values"].shape) == (2, v.num_channels, v.image_size, v.image_size)
    assert ((kw["input_ids"] == m.config.image_token_id).sum(1) == 4).all()
    assert _unread(m, kw) == set()
    rep = symgraph.analyze(m)
    slots = {p for g in rep.groups for p, *_ in g.params}
    assert any(p.startswith("model.vision_tower.") for p in slots)
    assert any(p.startswith("model.multi_modal_projector.") for p in slots)
    assert any(p.startswith("model.language_model.layers.") for p in slots)
    assert rep.certify(m) <= 1e-6

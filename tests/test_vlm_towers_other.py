"""Issue 65, vision-language rows whose tower the example inputs left unread (a parameter the
traced program never reads fixes every class, so such a model claimed nothing):

- the shrink rule keeps the widths a tower hands the text equal (a vision config's
  ``projection_dim`` in a config with an image token: Janus, Florence 2; a composite's merged
  width, a multiple of one tower's: MuseGlimmer's ``out_hidden_size``);
- a tower whose grid counts the text's image tokens, each token's pixels one small image
  channels last (Inkling 2), gets such images;
- a model with an image token and no ``get_image_features`` (its text cross-attends to the
  images: Mllama) gets what its own image processor makes, kept where the forward reads more;
  the shrink rule keeps its tower's output width (the last and the listed layers' states
  joined) in step with the layers it lists;
- a speech tower whose ``get_audio_features`` is its base model's (MuseSpark's) counts its
  audio tokens by it;
- a second sequence read by an encoder whose config is ``<name>_encoder_config`` (Evolla's
  protein) is given;
- attention over channels (DaViT's channel attention in Florence 2, which the images now reach):
  the softmax of each query row is its own, so the rows may only be permuted (the rule let an
  invertible map through, unsound).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import symgraph
from symgraph.passes.inputs import default_inputs
from analyze_helpers import unread

T = pytest.importorskip("transformers")


class ChannelAttention(torch.nn.Module):
    """Florence 2's channel attention: ``groups`` groups of channels attend to each other, the
    tokens being the head dimension."""

    def __init__(self, d=8, groups=2):
        super().__init__()
        self.groups = groups
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.groups, c // self.groups).permute(2, 0, 3, 4, 1).unbind(0)
        h = F.scaled_dot_product_attention(q, k, v, scale=n ** -0.5)  # b, groups, c / groups, n
        return self.proj(h.permute(0, 3, 2, 1).reshape(b, n, c))


def _classes_of(rep, slot):
    return [g for g in rep.groups if slot in [tuple(p) for p in g.params]]


def test_attention_over_channels_permutes_query_rows_only():
    torch.manual_seed(0)
    m = ChannelAttention().eval()
    x = torch.randn(2, 5, 8)
    rep = symgraph.analyze(m, (x,))
    rows = _classes_of(rep, ("proj.weight", 1))
    assert rows and all(g.kind == "perm" for g in rows)  # the query rows: permutations, not gl
    assert {g.kind for g in _classes_of(rep, ("qkv.weight", 0))} == {"perm"}
    assert rep.certify(m, (x,)) <= 1e-6


def _tiny(model_type):
    from benchmarks.coverage.shrink import tiny_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config(model_type)[1]


def test_a_towers_projection_is_the_text_width():
    """Janus' default states a 2048-wide projection beside a 4096-wide text; shrunk, the
    projection is the text's 64 (its aligner writes the image tokens' embeddings); MuseGlimmer's
    merged width (6144 = 4 × its 1536-wide tower) is 4 × the tower's shrunk 64; a vision model
    without an image token keeps its own (CLIP's classifier)."""
    janus = _tiny("janus")
    assert janus["vision_config"]["projection_dim"] == janus["text_config"]["hidden_size"] == 64
    glimmer = _tiny("muse_glimmer")
    assert glimmer["out_hidden_size"] == 4 * glimmer["vision_config"]["hidden_size"] == 256
    assert "projector_hidden_size" not in glimmer  # a width no tower divides: left alone
    florence = _tiny("florence2")["vision_config"]  # a width per stage, the last 1024: / 4
    assert tuple(florence["embed_dim"]) == (32, 64, 128, 256) and florence["projection_dim"] == 64
    mllama = _tiny("mllama")["vision_config"]  # 7680 = 1280 × (1 + 5 listed layers)
    assert mllama["vision_output_dim"] == 64 * (1 + len(mllama["intermediate_layers_indices"])) == 128
    clip = _tiny("clip")
    assert clip["vision_config"]["projection_dim"] != clip["text_config"]["hidden_size"]


def test_inkling2_images_counted_in_tokens():
    """Inkling 2's tower takes one small image (patch × merge a side, channels last) per text
    image token, its grid counted in those tokens: 2 × 2 tokens a row, every parameter read."""
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("inkling2", "Inkling2ForConditionalGeneration")
    v = m.config.vision_config
    _, kw = default_inputs(m)
    side = v.patch_size * v.spatial_merge_size
    assert tuple(kw["pixel_values"].shape) == (8, side, side, v.num_channels)
    assert kw["image_grid_thw"].tolist() == [[1, 2, 2]] * 2
    assert ((kw["input_ids"] == m.config.image_token_id).sum(1) == 4).all()
    assert unread(m, kw) == set()


def test_evolla_reads_its_protein_encoder():
    """Evolla's protein sequence (``protein_input_ids``) in range of its
    ``protein_encoder_config``'s vocabulary, with its mask: every parameter read."""
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("evolla", "EvollaForProteinText2Text")
    _, kw = default_inputs(m)
    ids = kw["protein_input_ids"]
    assert ids.shape[0] == 2 and int(ids.max()) < m.config.protein_encoder_config.vocab_size
    assert (kw["protein_attention_mask"] == 1).all()
    assert unread(m, kw) == set()


def test_mllama_images_through_its_processor():
    """Mllama counts no image features: its processor's tiles (one image of four tiles a row),
    their aspect ratio ids and mask are kept since the forward reads its vision tower on them;
    the decoder's encoder states are then not offered (the images make them)."""
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("mllama", "MllamaForConditionalGeneration")
    _, kw = default_inputs(m)
    assert tuple(kw["pixel_values"].shape) == (2, 1, 4, 3, 64, 64)
    assert tuple(kw["aspect_ratio_ids"].shape) == (2, 1) and tuple(kw["aspect_ratio_mask"].shape) == (2, 1, 4)
    assert "cross_attention_states" not in kw
    assert unread(m, kw) == set()


def test_muse_spark_reads_its_images_and_its_audio():
    """MuseSpark: its vision tower's merged width fits (4 × 64), so its images' features are
    counted; its audio features are counted by its base model's ``get_audio_features`` (125
    tokens for half a second of its extractor's audio), so its audio tower is read too."""
    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = build("muse_spark", "MuseSparkForConditionalGeneration")
    _, kw = default_inputs(m)
    assert kw["image_grid_thw"].shape[0] == 2 and "input_values_mask" in kw
    assert ((kw["input_ids"] == m.config.audio_token_id).sum(1) == 125).all()
    assert unread(m, kw) == set()

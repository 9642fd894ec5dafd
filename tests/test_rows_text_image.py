"""Issue 65: rows of the text and image tasks whose example inputs read every parameter. A
document model is given a box per token (``bbox``) where the boxes read more than its default
ones, and its page image (``pixel_values``): LayoutLMv3's patch embedding is then read, its
classes claimed and certified; UDOP, which refuses to run without boxes and clips them to
[0, 1], is given them as fractions of the page."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs

T = pytest.importorskip("transformers")


def _layoutlmv3():
    cfg = T.LayoutLMv3Config(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                             intermediate_size=64, coordinate_size=8, shape_size=8,
                             patch_size=16, max_2d_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    return T.LayoutLMv3ForSequenceClassification(cfg).eval()


def test_layoutlmv3_reads_its_page():
    """LayoutLMv3 reads every layout embedding on its default (all-zero) boxes, so boxes are not
    kept; the page image is, and with it the patch embedding."""
    m = _layoutlmv3()
    _, kw = default_inputs(m)
    assert "bbox" not in kw
    assert kw["pixel_values"].shape == (2, 3, 224, 224)  # the config's input_size (its default)
    rep = symgraph.analyze(m)
    assert rep.unread is None  # every parameter read
    per_head = [g for g in rep.groups if g.kind == "gl" and (g.blocks, g.dim) == (4, 12)]
    assert len(per_head) == 2  # each head's query-key and value-output maps (48 / 4 heads)
    assert any(g.kind == "perm" and g.size == 4 for g in rep.groups)  # the heads' order
    claimed = {p for g in rep.groups if g.kind != "identity" for p, _ in g.params}
    assert {"layoutlmv3.patch_embed.proj.weight", "layoutlmv3.embeddings.x_position_embeddings.weight",
            "layoutlmv3.encoder.layer.0.attention.self.query.weight"} <= claimed
    assert rep.certify(m) <= 1e-6


def test_udop_runs_on_boxes_as_fractions_of_the_page():
    """UDOP raises without boxes and clips them to [0, 1]: integer boxes are refused, the same
    boxes as fractions are kept, and the page image beside them."""
    cfg = T.UdopConfig(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_decoder_layers=1,
                       num_heads=4, image_size=32, patch_size=16)
    torch.manual_seed(0)
    m = T.UdopForConditionalGeneration(cfg).eval()
    _, kw = default_inputs(m)
    box = kw["bbox"]
    assert box.is_floating_point() and 0.0 <= float(box.min()) and float(box.max()) < 1.0
    assert (box[..., 2] > box[..., 0]).all() and (box[..., 3] > box[..., 1]).all()
    assert kw["pixel_values"].shape == (2, 3, 32, 32)
    with torch.no_grad():
        out = m(**kw)
    assert out.logits.shape == (*kw["decoder_input_ids"].shape, 64)


def test_no_boxes_for_a_model_without_a_layout():
    m = T.BertForSequenceClassification(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=48)).eval()
    _, kw = default_inputs(m)
    assert "bbox" not in kw and "pixel_values" not in kw


def _levit():
    cfg = T.LevitConfig(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2], depths=[1, 1, 1],
                        key_dim=[8, 8, 8], num_labels=3)
    torch.manual_seed(0)
    m = T.LevitForImageClassification(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("attention_biases"):  # zeros at init: random, so a wrong map would show
                p.copy_(torch.randn_like(p))
    return m


def test_levit_attention_biases_read_from_the_parameter_not_its_cache():
    """LeViT caches its gathered attention biases in eval mode (per device) and drops them on
    ``train()``; a trace after any eval run would read the cache, a constant, and leave the
    parameter unread (every class fixed). Tracing and certifying from ``train()`` then ``eval()``
    reads the parameter: each stage's heads are permuted with their biases."""
    m = _levit()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before = m(pixel_values=x).logits  # fills the cache
    rep = symgraph.analyze(m)
    assert rep.unread is None
    biases = {n for n, _ in m.named_parameters() if n.endswith("attention_biases")}
    claimed = {p for g in rep.groups if g.kind != "identity" for p, _ in g.params}
    assert biases and biases <= claimed, sorted(biases - claimed)
    assert any(g.kind == "perm" and g.size == 2 and any(p in biases for p, _ in g.params) for g in rep.groups)
    assert rep.certify(m) <= 1e-6
    with torch.no_grad():  # nothing traced stays cached: the model runs as before
        assert torch.allclose(m(pixel_values=x).logits, before)
    assert float((before[0] - before[1]).abs().max()) > 0.1 * float(before.abs().max())  # input-dependent
    with torch.no_grad():
        m(pixel_values=x)  # the cache filled again: a moved copy must not keep it
    for seed in range(8):
        moved = symgraph.transform(m, rep.random_transform(seed=seed))
        old, new = dict(m.named_parameters()), dict(moved.named_parameters())
        if any(not torch.equal(old[n], new[n]) for n in biases):
            break
    assert any(not torch.equal(old[n], new[n]) for n in biases)  # some heads' biases moved
    with torch.no_grad():
        out = moved.eval()(pixel_values=x).logits  # (small logits at init: compared relatively)
    assert float((out - before).abs().max() / before.abs().max()) < 1e-4

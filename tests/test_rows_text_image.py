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

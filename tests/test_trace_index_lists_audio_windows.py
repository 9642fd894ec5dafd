"""Issue 65, two more rows that failed in ``torch.export``.

- An index given as a sequence of 0-dim tensors (UDOP: ``rows, cols = zip(*ind);
  patch_inds[rows, cols] = False``) has torch read each element's data to build the index
  tensor, which a traced (fake) tensor does not have ("its data is not allocated"): while
  tracing it is stacked instead (:mod:`symgraph.passes.index_lists`), the same tensor.
- An audio encoder that attends within windows of ``n_window_infer`` frames (Qwen3-Omni's) is
  traced through transformers' own precomputed inputs and export patch, which runs the windows
  as one batch and so needs them equally long: the example's frames are a whole number of
  windows (:func:`symgraph.passes.audio_inputs.features`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.index_lists import stacked_index, stacked_index_lists
from symgraph.passes.inputs import default_inputs
from symgraph.passes.nodes import UNREAD
from symgraph.passes.trace import trace


def _groups_holding(rep, slot):
    return [g for g in rep.groups if slot in g.params]


def test_stacked_index_is_the_tensor_torch_would_build():
    r, c = (torch.tensor(0), torch.tensor(1)), (torch.tensor(2), torch.tensor(0))
    got = stacked_index((r, c))
    assert isinstance(got, tuple) and [t.tolist() for t in got] == [[0, 1], [2, 0]]
    assert got[0].dtype == torch.int64
    x = torch.arange(12).reshape(3, 4)
    assert x[r, c].tolist() == x[got].tolist() == [2, 4]
    flags = (torch.tensor(True), torch.tensor(False), torch.tensor(True))
    assert stacked_index((flags,))[0].dtype == torch.bool
    assert x[(flags,)].tolist() == x[stacked_index((flags,))].tolist()
    top = [torch.tensor(0), torch.tensor(1)]  # a top-level list: torch reads it as a tuple
    assert stacked_index(top) is top and stacked_index(3) == 3
    mixed = ((torch.tensor(0), torch.tensor(1, dtype=torch.int32)), slice(None))
    assert stacked_index(mixed) is mixed  # one dtype only: never a promotion torch would not do
    floats = ((torch.tensor(0.0),),)
    assert stacked_index(floats) is floats
    with stacked_index_lists():
        y = torch.zeros(3, 4)
        y[r, c] = 1.0
    assert y.nonzero().tolist() == [[0, 2], [1, 0]]
    y[r, c] = 2.0  # eager indexing after the context is torch's own again
    assert float(y.sum()) == 4.0


class PatchMarks(nn.Module):
    """UDOP's marks: the patch each token's point falls in is marked off by indexing with
    ``zip(*ind)`` (sequences of 0-dim tensors); the rest of the hidden rows are kept."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x, points):
        h = self.down(torch.relu(self.up(x)))
        keep = torch.ones_like(h[:, :, 0]).bool()
        batch = torch.arange(points.shape[0])[:, None].repeat(1, points.shape[1])
        ind = torch.stack([batch, points], -1).flatten(0, 1)
        rows, cols = zip(*ind)
        keep[rows, cols] = False
        return h * keep[..., None].to(h.dtype), h[rows, cols]


def test_an_index_of_zero_dim_tensors_traces_and_certifies():
    torch.manual_seed(0)
    model = PatchMarks().eval()
    inp = {"x": torch.randn(2, 5, 6), "points": torch.tensor([[0, 3], [4, 4]])}
    trace(model, inp)  # raised "its data is not allocated yet" before
    rep = symgraph.analyze(model, inp)
    (hidden,) = _groups_holding(rep, ("up.weight", 0))
    assert hidden.kind in ("perm", "scaled_perm") and hidden.size == 12
    assert {("down.weight", 1), ("up.bias", 0)} <= set(hidden.params)
    assert rep.certify(model, inp) <= 1e-6
    with torch.no_grad():
        out, picked = model(**inp)
    assert out[0, 0].abs().sum() == 0 and out[1, 4].abs().sum() == 0 and out[0, 1].abs().sum() > 0
    assert picked.shape == (4, 6)


pytest.importorskip("transformers")


@pytest.mark.slow
def test_udop_traces_and_its_decoder_patch_embeddings_stay_unread():
    """UDOP traces now; its decoder stack is built with patch embeddings and 2-D relative biases
    that ``UdopForConditionalGeneration.forward`` never hands pixels or boxes to (it calls the
    decoder without them, and takes ``pixel_values`` and ``bbox`` by name), so no input reads
    them: the model claims nothing, as the soundness rule says (the row stays blocked)."""
    from benchmarks.coverage.shrink import build
    model, _ = build("udop", "UdopForConditionalGeneration")
    kwargs = default_inputs(model)[1]
    assert {"pixel_values", "bbox", "decoder_input_ids"} <= set(kwargs)
    for _ in range(2):  # the same program twice: tracing leaves the model and torch as they were
        ep = trace(model)[0]
        assert sorted(ep.graph_module.meta[UNREAD]) == [
            "decoder.embed_patches.proj.bias", "decoder.embed_patches.proj.weight",
            "decoder.relative_bias.biases.1.relative_attention_bias.weight",
            "decoder.relative_bias.biases.2.relative_attention_bias.weight"]
    rep = symgraph.analyze(model)
    assert rep.groups == [] and "decoder.embed_patches.proj" in rep.summary()
    assert rep.certify(model) <= 1e-6


@pytest.mark.slow
def test_qwen3_omni_audio_windows_trace_and_certify():
    from benchmarks.coverage.shrink import build
    model, _ = build("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration")
    kwargs = default_inputs(model)[1]
    window = model.config.audio_config.n_window_infer
    frames = kwargs["input_features"].shape[-1]
    assert frames % window == 0 and frames == 3000 // window * window  # 2400: three windows, not 3¾
    assert kwargs["feature_attention_mask"].shape[-1] == frames
    rep = symgraph.analyze(model)
    (fc,) = _groups_holding(rep, ("model.audio_tower.layers.0.fc1.weight", 0))
    assert fc.kind == "perm" and fc.size == 256 and ("model.audio_tower.layers.0.fc2.weight", 1) in fc.params
    (mlp,) = _groups_holding(rep, ("model.visual.blocks.0.mlp.linear_fc1.weight", 0))
    assert mlp.kind == "perm" and mlp.size == 240
    assert rep.certify(model) <= 1e-6

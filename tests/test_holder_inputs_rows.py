"""Issue 65, coverage rows a holder's optional argument completes (:mod:`symgraph.passes.holder_inputs`),
each on a tiny model from its config, analysed with no inputs: DPT's first fusion layer, called with
no ``residual`` (its ``residual_layer1`` run on its own input), Tipsv2's embeddings called without
``bool_masked_pos`` (its mask token), SpeechT5's speech prenet without ``mask_time_indices`` (its
masked frame embedding). Each reads every parameter, puts the newly read one in the class of the
stream it joins, certifies in float64, runs as the plain model on another batch, and is recovered
by weight matching from a transformed copy."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.holder_inputs import HOLDERS, Injection
from symgraph.passes.trace import flatten_outputs
from symgraph.testing.models import randomized

from test_holder_inputs import recovered

T = pytest.importorskip("transformers")


def _same_on_another_batch(rep, model, kwargs) -> float:
    """The largest difference, relative to the output's size, between the program and the model."""
    dtype = next(m.parameters()).dtype if (m := model) else None
    kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    with torch.no_grad():
        got = flatten_outputs(rep.exported_program.module()(**kwargs))
        want = flatten_outputs(model.eval()(**kwargs))
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


def _injected(rep) -> list:
    return rep.exported_program.graph_module.meta[HOLDERS]


def _checked(m, rep, other: dict) -> None:
    assert rep.unread is None
    assert rep.certify(m) <= 1e-6
    assert _same_on_another_batch(rep, m, other) < 1e-12  # the plain forward (in the model's float64)
    assert recovered(m, rep, rep.inputs[1]) < 1e-5


@pytest.mark.slow
def test_dpt_fusion_layer_zero_reads_its_residual_layer():
    cfg = T.DPTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, intermediate_size=24, image_size=32,
                      patch_size=8, backbone_out_indices=[0, 1, 2, 3], fusion_hidden_size=8,
                      neck_hidden_sizes=[8, 8, 8, 8], reassemble_factors=[4, 2, 1, 0.5], num_labels=3,
                      pooler_output_size=16)
    m = randomized(T.DPTForSemanticSegmentation(cfg))
    rep = symgraph.analyze(m)
    assert _injected(rep) == [Injection("neck.fusion_stage.layers.0", "residual", index=0)]
    res = "neck.fusion_stage.layers.0.residual_layer1.convolution"
    (inner,) = rep.group_of(res + "1.weight", 0)
    (stream,) = rep.group_of(res + "1.weight", 1)
    assert inner.kind == stream.kind == "scaled_perm" and inner.size == stream.size == 8  # after a ReLU each
    assert rep.group_of(res + "2.weight", 1) == [inner] and rep.group_of(res + "2.weight", 0) == [stream]
    assert rep.group_of("neck.fusion_stage.layers.0.projection.weight", 1) == [stream]  # the layer's stream
    _checked(m, rep, {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))})


@pytest.mark.slow
def test_tipsv2_dpt_embeddings_read_their_mask_token():
    vision = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, mlp_ratio=2, image_size=28,
                  patch_size=14, num_register_tokens=1, out_indices=[1, 2, 3, 4], reshape_hidden_states=False,
                  model_type="tipsv2_vision_model")
    cfg = T.Tipsv2DptConfig(backbone_config=vision, neck_hidden_sizes=[8, 8, 8, 8], fusion_hidden_size=8,
                            num_labels=3)
    m = randomized(T.Tipsv2DptForSemanticSegmentation(cfg))
    rep = symgraph.analyze(m)
    ((inj, shape),) = [(i, i.shape) for i in _injected(rep)]
    assert (inj.path, inj.arg, shape) == ("backbone.embeddings", "bool_masked_pos", (2, 4))  # (28 / 14)² patches
    (stream,) = rep.group_of("backbone.embeddings.mask_token", 1)
    assert stream.kind != "identity" and stream.size == 16
    assert rep.group_of("backbone.embeddings.patch_embeddings.projection.weight", 0) == [stream]
    x = torch.randn(rep.inputs[1]["pixel_values"].shape, generator=torch.Generator().manual_seed(5))
    _checked(m, rep, {"pixel_values": x})


@pytest.mark.slow
def test_speecht5_prenet_reads_its_masked_frame_embedding():
    cfg = T.SpeechT5Config(vocab_size=64, hidden_size=16, encoder_layers=1, encoder_attention_heads=4,
                           encoder_ffn_dim=24, decoder_layers=1, decoder_ffn_dim=24, decoder_attention_heads=4,
                           conv_dim=[8, 8], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=4,
                           num_conv_pos_embedding_groups=1, speech_decoder_prenet_layers=1, speaker_embedding_dim=8,
                           speech_decoder_postnet_layers=1, max_speech_positions=64, max_text_positions=32)
    m = randomized(T.SpeechT5ForSpeechToText(cfg))
    rep = symgraph.analyze(m)
    (inj,) = _injected(rep)
    assert (inj.path, inj.arg) == ("speecht5.encoder.prenet", "mask_time_indices") and inj.shape is not None
    pre = "speecht5.encoder.prenet."
    key = lambda name: rep.axis_key(rep.param_axes(name)[0])  # noqa: E731
    assert key(pre + "masked_spec_embed") == key(pre + "feature_projection.projection.weight")  # one stream
    # (fixed by the weight-normed positional convolution and the GELUs); the feature encoder's
    # channels, which the unread embedding fixed, now move
    (conv,) = rep.group_of(pre + "feature_encoder.conv_layers.0.conv.weight", 0)
    assert conv.kind == "perm" and conv.size == 8
    kw = dict(rep.inputs[1])
    kw["input_values"] = torch.randn(kw["input_values"].shape, generator=torch.Generator().manual_seed(5))
    _checked(m, rep, kw)


@pytest.mark.slow
def test_granite_docling_connector_takes_its_fine_path_too():
    from analyze_helpers import coverage_row
    m = randomized(coverage_row("granite_docling", "GraniteDoclingForConditionalGeneration"))
    rep = symgraph.analyze(m)
    assert [(i.arg, i.flag) for i in _injected(rep)] == [("fine", True)]
    assert rep.unread is None and rep.certify(m) <= 1e-6
    path = "model.vision_model.connector.{}.projection.weight"
    (g,) = rep.group_of(path.format("fine"), 1)  # its input units: a class, as the coarse path's
    assert g.kind == "perm" and [len(rep.group_of(path.format(p), 1)) for p in ("coarse", "fine")] == [1, 1]

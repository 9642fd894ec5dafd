"""Issue 65, the RT-DETR family's detection rows: their eval forward never reads the denoising
class embedding (contrastive denoising reads it in training, with labels), so every parameter
stays fixed. Built without it (``num_denoising=0``), a tiny RT-DETR v2 is complete: every class
the coverage checker expects is found (the box heads the model shares with its decoder under two
names, the deformable attention's per-head sampling offsets and weights), it certifies and a
moved copy is aligned back by weights. With it, the embedding is read by a training run
(:mod:`symgraph.passes.training_runs`) and the row is as complete."""
from __future__ import annotations

import importlib

import pytest
import torch

import symgraph
from symgraph.passes.training_runs import TrainingRun
from symgraph.report.certify import extra_runs
from symgraph.testing.models import randomized

T = pytest.importorskip("transformers")
apply_module = importlib.import_module("symgraph.transform.apply")  # symgraph.transform is also a function


def _rt_detr_v2(num_denoising: int):
    bb = T.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[16, 16, 24, 32], depths=[1, 1, 1, 1],
                              layer_type="bottleneck", downsample_in_first_stage=False,
                              out_features=["stage2", "stage3", "stage4"])
    cfg = T.RTDetrV2Config(backbone_config=bb, encoder_hidden_dim=16, encoder_in_channels=[16, 24, 32],
                           encoder_ffn_dim=24, encoder_attention_heads=2, d_model=16,
                           decoder_in_channels=[16, 16, 16], decoder_ffn_dim=24, decoder_layers=2,
                           decoder_attention_heads=2, num_queries=8, num_labels=3, decoder_n_points=2,
                           num_denoising=num_denoising)
    torch.manual_seed(0)
    return randomized(T.RTDetrV2ForObjectDetection(cfg))  # no zero-initialised box layer


def _missing(m, rep) -> list:
    from benchmarks.coverage.structure import expectations
    return expectations(rep.exported_program, rep, m.config, symgraph.tied_parameters(m))["missing"]


def _rel(a, b) -> float:
    num = sum(float((p.double() - q.double()).norm() ** 2) for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum(float(p.double().norm() ** 2) for p in a.parameters())) ** 0.5


@pytest.mark.slow
def test_rt_detr_v2_without_denoising_is_complete_sound_and_recovered():
    m = _rt_detr_v2(0)
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.frozen == []
    assert _missing(m, rep) == []
    claimed = {p for g in rep.groups for p, _ in g.params}
    assert {n for n, p in m.named_parameters() if p.dim() > 1} <= claimed
    # the box head of decoder layer 0: one tensor under two names, two ReLU classes of 16 units
    assert rep.aliases["model.decoder.bbox_embed.0.layers.1.weight"] == ["bbox_embed.0.layers.1.weight"]
    head = "model.decoder.bbox_embed.0.layers."
    (first,) = rep.group_of(head + "0.weight", 0)
    (second,) = rep.group_of(head + "1.weight", 0)
    assert (first.kind, first.size, second.kind, second.size) == ("scaled_perm", 16, "scaled_perm", 16)
    assert (head + "1.weight", 1) in first.params and (head + "2.weight", 1) in second.params
    # deformable attention: the sampling offsets and attention weights move with the value heads
    att = "model.decoder.layers.0.encoder_attn."
    heads = {(g.id, g.kind, g.size) for g in rep.group_of(att + "value_proj.weight", 0) if g.size == 2}
    assert heads and heads == {(g.id, g.kind, g.size) for g in rep.group_of(att + "sampling_offsets.weight", 0)}
    assert heads == {(g.id, g.kind, g.size) for g in rep.group_of(att + "attention_weights.weight", 0)}
    assert rep.certify(m) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=1))  # unit scales too
    assert _rel(m, moved) > 0.5 and rep.certify(moved) <= 1e-6
    back = symgraph.align(m, moved, report_a=rep, full_groups=True).apply(moved)
    assert _rel(m, back) < 1e-5


@pytest.mark.slow
def test_rt_detr_v2_with_denoising_reads_its_embedding_in_a_training_run(monkeypatch):
    """The denoising embedding is read by the model's inner module run again in training mode on
    labels built from the config: its width axis joins the decoder stream's class, the row is
    complete, the certificate judges the training run too, and a moved copy comes back by weights;
    the program still computes the plain eval forward."""
    m = _rt_detr_v2(4)
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.frozen == [] and _missing(m, rep) == []
    assert extra_runs(rep) == [TrainingRun("model", labels=True)]
    (stream,) = rep.group_of("model.denoising_class_embed.weight", 1)
    assert (stream.kind, stream.size) == ("perm", 16)
    assert rep.group_of("model.decoder.layers.0.self_attn.q_proj.weight", 1) == [stream]
    assert rep.group_of("model.enc_output.0.weight", 0) == [stream]
    assert rep.group_of("model.denoising_class_embed.weight", 0) == []  # class ids: fixed
    x = rep.inputs[1]["pixel_values"]
    with torch.no_grad():
        want = m.eval()(pixel_values=x).logits
        got = rep.exported_program.module()(pixel_values=x).logits
    assert torch.equal(got, want)
    assert rep.certify(m) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=1))
    assert _rel(m, moved) > 0.5 and rep.certify(moved) <= 1e-6
    back = symgraph.align(m, moved, report_a=rep, full_groups=True).apply(moved)
    assert _rel(m, back) < 1e-5
    real = apply_module.transform  # every transform certify applies leaves the embedding as it was

    def unmoved(model, t, *a, **kw):
        out = real(model, t, *a, **kw)
        with torch.no_grad():
            out.model.denoising_class_embed.weight.copy_(model.model.denoising_class_embed.weight)
        return out
    monkeypatch.setattr(apply_module, "transform", unmoved)
    with pytest.raises(symgraph.CertificationError, match="run in training mode on labels"):
        rep.certify(m)  # the eval forward never reads it: only the training run sees it

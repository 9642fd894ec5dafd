"""Issue 65, the RT-DETR family's detection rows: their eval forward never reads the denoising
class embedding (contrastive denoising reads it in training, with labels), so every parameter
stays fixed. Built without it (``num_denoising=0``), a tiny RT-DETR v2 is complete: every class
the coverage checker expects is found (the box heads the model shares with its decoder under two
names, the deformable attention's per-head sampling offsets and weights), it certifies and a
moved copy is aligned back by weights. With it, each missing class is explained by the unread
embedding, under the name the report gives a tied tensor."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.testing.models import randomized

T = pytest.importorskip("transformers")


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


def test_rt_detr_v2_with_denoising_names_the_unread_embedding_for_every_missing_class():
    m = _rt_detr_v2(4)
    rep = symgraph.analyze(m)
    assert "model.denoising_class_embed.weight" in rep.unread
    assert rep.groups == [] and rep.certify(m) <= 1e-6
    missing = _missing(m, rep)
    box = [x for x in missing if x["module"].startswith("bbox_embed.")]  # read under the alias
    assert len(box) == 4 and len(missing) == 34
    assert all("model.denoising_class_embed.weight is never read" in x["why"] for x in missing)

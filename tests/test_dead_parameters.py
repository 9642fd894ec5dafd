"""Issue 65, parameters dead in the model's own code (``symgraph.passes.deadcode``). An unread
parameter no method of its module's source reads (MarkupLM's ``xpath_unitseq2_embeddings``) is
proven dead by a static check of that source: it alone stays fixed, the rest of the model keeps
its classes, and the report lists it. One read by another method or through a computed name is
not proven: every parameter stays fixed, as for any unread parameter. A list item is left to
``symgraph.passes.closed_reads``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.deadcode import dead_parameters

from dead_models import Blocks, DeadMLP, Handed, Hooked, ReadByName, ReadElsewhere, Scaled, Shadowed, Shelved, Stack, Walked

# the models live in a file of their own: the names this file asserts on are strings here
STATIC = "never read by any method of dead_models.py (static check)"


def _x():
    torch.manual_seed(1)
    return (torch.randn(4, 6),)


def _hidden(rep):
    return next(g for g in rep.groups if ("up.weight", 0) in g.params)


def test_dead_parameters_stay_fixed_alone_and_the_mlp_is_found():
    torch.manual_seed(0)
    A = DeadMLP().eval()
    rep = symgraph.analyze(A, _x())
    assert rep.unread is None
    assert rep.dead_parameters == {"spare.weight": STATIC, "spare.bias": STATIC, "sep": STATIC}
    hidden = _hidden(rep)
    assert hidden.kind == "scaled_perm" and hidden.size == 16  # ReLU: positive scales too
    assert set(hidden.params) == {("up.weight", 0), ("up.bias", 0), ("down.weight", 1)}
    assert not any(p.startswith(("spare.", "sep")) for g in rep.groups for p, _ in g.params)
    why = [r for leaf in rep.axis_reasons("spare.weight", 0) for _, r in leaf["reasons"]]
    assert f"spare.weight is {STATIC}" in why
    assert f"sep alone stays fixed: {STATIC}" in rep.summary()
    assert rep.to_dict()["dead_parameters"] == rep.dead_parameters
    assert rep.certify(A, _x()) <= 1e-12
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))  # a permutation
    assert float((A.up.weight - B.up.weight).abs().max()) > 0.1
    assert torch.equal(A.spare.weight, B.spare.weight) and torch.equal(A.sep, B.sep)
    C = symgraph.align(A, B, _x()).apply(B)  # weights only: B aligned back is A
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-6, n


def test_a_layer_read_by_another_method_is_traced_through_that_method():
    """``predict(x)`` reads the layer and vector: the trace runs it beside the forward
    (:mod:`symgraph.passes.entry_points`), so they are read and move with the hidden units,
    and the method's result is kept as it is."""
    torch.manual_seed(0)
    A = ReadElsewhere().eval()
    rep = symgraph.analyze(A, _x())
    assert rep.dead_parameters == {} and rep.unread is None
    hidden = _hidden(rep)
    assert ("spare.weight", 1) in hidden.params and hidden.kind == "scaled_perm"
    assert rep.group_of("sep", 0) == rep.group_of("spare.weight", 0) == []  # the method's result: fixed
    assert rep.certify(A, _x()) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=1))
    with torch.no_grad():
        assert float((A.predict(*_x()) - B.predict(*_x())).abs().max()) < 1e-5


@pytest.mark.parametrize("cls", [ReadByName])
def test_a_layer_read_by_a_computed_name_fixes_everything(cls):
    torch.manual_seed(0)
    A = cls().eval()
    rep = symgraph.analyze(A, _x())
    assert rep.dead_parameters == {} and rep.groups == []
    assert rep.unread == ("sep (and 2 more) is never read by the traced inputs: "
                          "pass inputs that use it")
    why = [r for leaf in rep.axis_reasons("up.weight", 0) for _, r in leaf["reasons"]]
    assert rep.unread in why


def test_a_list_item_no_constant_index_names_is_dead_by_the_closed_reads_proof_only():
    """This proof takes no position in a list; :mod:`symgraph.passes.closed_reads` proves the
    item dead, its list loaded only as ``self.blocks[0]``."""
    torch.manual_seed(0)
    A = Blocks().eval()
    names = ["blocks.1.weight", "blocks.1.bias"]
    assert dead_parameters(A, names) == {}
    rep = symgraph.analyze(A, _x())
    assert rep.unread is None
    assert rep.dead_parameters == {n: "blocks is read only at 0, by constant indices in Blocks (static check)"
                                   for n in names}
    hidden = next(g for g in rep.groups if ("blocks.0.weight", 0) in g.params)
    assert hidden.kind == "scaled_perm" and hidden.size == 16
    assert rep.certify(A, _x()) <= 1e-12


def test_the_proof_refuses_what_it_cannot_see():
    A = DeadMLP()
    assert dead_parameters(A, ["spare.weight", "up.weight"]) == {"spare.weight": STATIC}
    assert dead_parameters(nn.Sequential(nn.Linear(2, 2)), ["0.weight"]) == {}  # torch's own class
    Local = type("Local", (nn.Module,), {})  # no source to read
    m = Local()
    m.spare = nn.Linear(2, 2)
    assert dead_parameters(m, ["spare.weight"]) == {}
    assert dead_parameters(A, ["no.such.parameter"]) == {}
    assert dead_parameters(Handed(), ["spare.weight"]) == {}  # self handed to another function
    assert dead_parameters(Hooked(), ["extra.weight"]) == {}  # Hooker's hook: its self is any module
    assert dead_parameters(Stack([nn.Linear(2, 2)]), ["0.weight"]) == {}  # a list of its own class
    assert dead_parameters(Scaled(2, 2), ["weight"]) == {}  # nn.Linear's forward reads it
    assert dead_parameters(nn.Sequential(DeadMLP()), ["0.spare.weight"]) == {"0.spare.weight": STATIC}
    inside = nn.Linear(2, 2)  # a torch layer above: its code may name what it holds
    inside.add_module("inner", DeadMLP())
    assert dead_parameters(inside, ["inner.spare.weight"]) == {}


def test_a_block_never_called_is_dead_whatever_its_own_forward_reads():
    torch.manual_seed(0)
    A = Shelved().eval()
    rep = symgraph.analyze(A, _x())
    shelf = [n for n, _ in A.named_parameters() if n.startswith("shelf.")]
    assert len(shelf) == 6 and rep.unread is None
    assert rep.dead_parameters == {n: STATIC for n in shelf}  # Blocks.forward reads them: not called
    hidden = _hidden(rep)
    assert hidden.size == 16 and set(hidden.params) == {("up.weight", 0), ("up.bias", 0), ("down.weight", 1)}
    assert rep.certify(A, _x()) <= 1e-12
    # ``self`` handed to a function reaching its members: nothing under it is proven dead
    assert dead_parameters(Walked(), shelf) == {}
    assert dead_parameters(Shadowed(), shelf) == {}  # ``plain`` bound as an argument: any function


def test_wav2vec2_conformer_positional_convolution_is_dead():
    pytest.importorskip("transformers")
    from analyze_helpers import coverage_row
    m = coverage_row("wav2vec2-conformer", "Wav2Vec2ConformerForCTC")
    names = [n for n, _ in m.named_parameters() if ".pos_conv_embed." in n]
    why = "never read by any method of modeling_wav2vec2_conformer.py (static check)"
    assert len(names) == 3 and dead_parameters(m, names) == {n: why for n in names}
    rep = symgraph.analyze(m)
    assert rep.unread is None and set(rep.dead_parameters) == set(names)
    assert rep.certify(m) <= 1e-6
    assert rep.group_of("wav2vec2_conformer.encoder.layers.0.ffn1.intermediate_dense.weight", 0)[0].kind == "perm"


def test_markuplm_sequence_classification_is_complete():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MarkupLMConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, max_depth=4, xpath_unit_hidden_size=8, num_labels=3)
    torch.manual_seed(0)
    A = transformers.MarkupLMForSequenceClassification(cfg).eval()
    rep = symgraph.analyze(A)
    spare = "markuplm.embeddings.xpath_embeddings.xpath_unitseq2_embeddings"
    assert rep.unread is None
    assert rep.dead_parameters == {f"{spare}.{p}": "never read by any method of modeling_markuplm.py "
                                   "(static check)" for p in ("weight", "bias")}
    (mlp,) = [g for g in rep.groups if ("markuplm.encoder.layer.0.intermediate.dense.weight", 0) in g.params]
    assert mlp.kind == "perm" and mlp.size == 24
    stream = rep.group_of("markuplm.embeddings.word_embeddings.weight", 1)
    assert stream and stream[0].kind != "identity"
    assert rep.certify(A) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    C = symgraph.align(A, B).apply(B)  # weights only
    want, was, got = A.state_dict(), B.state_dict(), C.state_dict()
    assert max(float((was[k] - want[k]).abs().max()) for k in want) > 0.1
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-5


@pytest.mark.parametrize("model_type, cls, name, dead", [
    # ReformerOnlyLMHead.bias: `bias` is loaded in that file only as `new_embeddings.bias`, moved
    ("reformer", "ReformerForMaskedLM", "lm_head.bias", True),
    ("hunyuan_vl", "HunYuanVLForConditionalGeneration", "model.vision_tower.patch_merger.image_sep", True),
    ("esm", "EsmForMaskedLM", "esm.contact_head.regression.weight", False),  # predict_contacts reads it
    ("udop", "UdopForConditionalGeneration", "decoder.embed_patches.proj.weight", False),  # read on pixels
    # its own _freeze_parameters and PreTrainedModel (dtype, post_init) reach parameters generically
    ("qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration",
     "model.audio_tower.audio_bos_eos_token.weight", False),
])
def test_coverage_rows_dead_or_not(model_type, cls, name, dead):
    pytest.importorskip("transformers")
    from analyze_helpers import coverage_row
    m = coverage_row(model_type, cls)
    assert name in dict(m.named_parameters())
    why = f"never read by any method of modeling_{model_type}.py (static check)"
    assert dead_parameters(m, [name]) == ({name: why} if dead else {})


def test_a_branch_the_block_decides_against_leaves_its_layer_dead():
    from dead_models import Restrided, Strided, TrainOnly
    names = ["gate.weight", "gate.bias"]
    assert dead_parameters(TrainOnly(2).eval(), names) == {}  # read in training
    assert dead_parameters(Strided(2), names) == {n: STATIC for n in names}
    assert dead_parameters(Strided(1), names) == {}  # taken: read
    assert dead_parameters(Restrided(2), names) == {}  # a method stores the stride: not proven


@pytest.mark.slow
def test_pp_ocrv5_activation_block_skipped_at_stride_2_is_dead():
    pytest.importorskip("transformers")
    from analyze_helpers import coverage_row
    m = coverage_row("pp_ocrv5_mobile_det", "PPOCRV5MobileDetForObjectDetection")
    layers = "model.backbone.encoder.blocks.1.layers"
    assert m.get_submodule(f"{layers}.0.depthwise_convolution").stride == 2
    assert m.get_submodule(f"{layers}.1.depthwise_convolution").stride == 1
    dead = dead_parameters(m, [f"{layers}.{i}.depthwise_convolution.act.lab.scale" for i in (0, 1)])
    assert list(dead) == [f"{layers}.0.depthwise_convolution.act.lab.scale"]
    report = symgraph.analyze(m)
    assert report.unread is None and report.certify(m) <= 1e-6
    assert any(g.module.endswith("squeeze_excitation_module.convolutions") for g in report.groups)

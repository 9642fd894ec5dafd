"""Issue 65, parameters read only on a path every caller closes (``symgraph.passes.closed_reads``).
A block that embeds token ids only when handed no embeddings, always handed them by its parent
(PI0's action model, a Gemma model called with ``inputs_embeds``): its table is read by no
method, stays fixed alone, and the block's hidden units keep their class. A call that may hand
it None, one that hands it token ids, a reach of the table by name, or embeddings replaced
before the test: not proven, every parameter stays fixed."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.closed_reads import closed_parameters

from closed_models import (Host, MarkedHost, MaybeNone, NamedHost, Pilot, PilotOfReassigned, ProbedHost, Reached,
                           Tokens, Wrapped, WrappedWithMixin)

WHY = ("loaded by Block.forward, the ways block is called, only where embeds is None, which every call passes "
       "a tensor (static check)")


def _x():
    torch.manual_seed(1)
    return (torch.randn(5, 4),)


def test_a_table_every_caller_bypasses_stays_fixed_alone():
    torch.manual_seed(0)
    A = Pilot().eval()
    rep = symgraph.analyze(A, _x())
    assert rep.unread is None
    assert rep.dead_parameters == {"block.table.weight": WHY}
    hidden = next(g for g in rep.groups if ("block.up.weight", 0) in g.params)
    assert hidden.kind == "scaled_perm" and hidden.size == 16
    assert not any(p.startswith("block.table") for g in rep.groups for p, _ in g.params)
    assert rep.certify(A, _x()) <= 1e-12
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    assert float((A.block.up.weight - B.block.up.weight).abs().max()) > 0.1
    assert torch.equal(A.block.table.weight, B.block.table.weight)
    C = symgraph.align(A, B, _x()).apply(B)  # weights only: B aligned back is A
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-6, n


@pytest.mark.parametrize("cls", [MaybeNone, Tokens, Reached, PilotOfReassigned])
def test_a_path_some_caller_or_the_block_may_open_is_not_proven(cls):
    assert closed_parameters(cls(), ["block.table.weight"]) == {}


def test_optional_embeddings_fix_every_class():
    torch.manual_seed(0)
    A = MaybeNone().eval()
    rep = symgraph.analyze(A, _x())
    assert rep.dead_parameters == {} and rep.unread is not None
    assert not any(g.size > 1 for g in rep.groups)


def test_a_member_no_way_in_loads_stays_fixed_alone():
    """Qwen2.5-Omni's audio tower holds an embedding its forward and the method its caller uses
    never load (another method reaches its parameters by no name, as its ``_freeze_parameters``
    does: :mod:`symgraph.passes.deadcode` proves nothing): dead, and the tower's hidden units keep
    their class."""
    torch.manual_seed(0)
    A = Host().eval()
    x = (torch.randn(8, 6),)
    rep = symgraph.analyze(A, x)
    assert rep.unread is None
    assert rep.dead_parameters == {"tower.marker.weight": "loaded by none of Tower.kept, Tower.forward, the ways "
                                                          "tower is called (static check)"}
    hidden = next(g for g in rep.groups if ("tower.up.weight", 0) in g.params)
    assert hidden.kind == "scaled_perm" and hidden.size == 16
    assert rep.certify(A, x) <= 1e-12
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    assert float((A.tower.up.weight - B.tower.up.weight).abs().max()) > 0.1
    assert torch.equal(A.tower.marker.weight, B.tower.marker.weight)
    C = symgraph.align(A, B, x).apply(B)
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-6, n


@pytest.mark.parametrize("cls", [MarkedHost, NamedHost])
def test_a_member_a_way_in_loads_or_a_name_reaches_is_not_proven(cls):
    assert closed_parameters(cls(), ["tower.marker.weight"]) == {}


@pytest.mark.parametrize("model_type, cls, name, why", [
    ("pi0", "PI0ForConditionalGeneration", "model.dit.embed_tokens.weight",
     "loaded by GemmaModel.forward, the ways dit is called, only where inputs_embeds is None, which every "
     "call passes a tensor (static check)"),
    ("qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration",
     "model.audio_tower.audio_bos_eos_token.weight",
     "loaded by none of Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths, "
     "Qwen2_5OmniAudioEncoder.forward, the ways audio_tower is called (static check)"),
    # the decoder is named in UDOP's own strings (its tied keys): not proven
    ("udop", "UdopForConditionalGeneration", "decoder.embed_patches.proj.weight", None),
])
def test_coverage_rows_closed_or_not(model_type, cls, name, why):
    pytest.importorskip("transformers")
    from analyze_helpers import coverage_row
    m = coverage_row(model_type, cls)
    assert closed_parameters(m, [name]) == ({name: why} if why else {})


def test_a_mixin_of_a_model_above_that_calls_another_method_is_read():
    """A bound that reads only the model's own class missed a mixin in another file (VibeVoice's
    generation mixin decodes audio through its tokenizer's ``decode``): every class of every
    module above is read."""
    name = "host.tower.marker.weight"
    assert closed_parameters(Wrapped(), [name]) == {name: "loaded by none of DecodingTower.kept, "
                                                          "DecodingTower.forward, the ways tower is called "
                                                          "(static check)"}
    assert closed_parameters(WrappedWithMixin(), [name]) == {}


def test_a_method_beside_a_member_proven_dead_only_statically_is_kept():
    """The entry points take the trace's proof of what stays unread: a probe only a public
    method reads runs as an entry point while the tower's marker, which :mod:`.deadcode`
    cannot prove dead (the tower reaches its members by no name) but the static reading does,
    stays unread. Before, only :mod:`.deadcode`'s proof counted: the method was dropped and
    the unread probe fixed every class."""
    torch.manual_seed(0)
    A = ProbedHost().eval()
    x = (torch.randn(8, 6),)
    rep = symgraph.analyze(A, x)
    assert rep.unread is None and list(rep.dead_parameters) == ["tower.marker.weight"]
    hidden = next(g for g in rep.groups if ("tower.up.weight", 0) in g.params)
    assert hidden.kind == "scaled_perm" and hidden.size == 16
    assert rep.certify(A, x) <= 1e-12
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    with torch.no_grad():
        assert float((A.predict_probe(x[0]) - B.predict_probe(x[0])).abs().max()) < 1e-5  # the method too

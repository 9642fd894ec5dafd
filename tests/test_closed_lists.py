"""Issue 65, three more proofs of ``symgraph.passes.closed_reads``: a load under ``if mask is not
None and ...`` where no caller passes the mask (its default None; RF-DETR's Dinov2 mask token), a
list of modules whose every load is an index by a constant (PP-DocLayoutV4's class heads, of which
its decoder reads the last), and a member no method loads, its holder's mixin reaching members by
no name (PP-DocLayoutV4's denoising embedding). The parameter is dead, fixed alone, and the
classes around it are claimed, certified and recovered; a variant that may read it is not
proven."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.closed_reads import closed_parameters
from symgraph.passes.training_runs import TrainingRun, training_runs
from symgraph.report.certify import extra_runs

from closed_list_models import (Chain, CountedHeads, Encoder, EncoderOfReading, ForwardMaskedEncoder, Heads,
                                IteratedHeads, LoadedSpare, MaskedEncoder, PickedHeads, SlicedHeads, Spare,
                                StackedHeads, TrainedHost, ZippedHeads)
from closed_outer_models import OuterHeads

UNPASSED = ("loaded by Patches.forward, the ways patches is called, only where mask is not None, which no call "
            "passes (static check)")
INDEXED = "heads is read only at 2, by constant indices in Heads (static check)"
UNLOADED = "spare is loaded by no method of Spare nor above it (static check)"


def _x():
    torch.manual_seed(1)
    return (torch.randn(5, 4),)


def _claimed(A, dead: dict, hidden: str):
    """The report of ``A``: ``dead`` its dead parameters, the hidden units of ``hidden`` one
    class of 16, every dead parameter in no class, certified, a transformed copy aligned back."""
    rep = symgraph.analyze(A, _x())
    assert rep.unread is None
    assert rep.dead_parameters == dead
    group = next(g for g in rep.groups if (hidden, 0) in g.params)
    assert group.kind == "scaled_perm" and group.size == 16
    assert not any(p in dead for g in rep.groups for p, _ in g.params)
    assert rep.certify(A, _x()) <= 1e-12
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    assert float((A.get_parameter(hidden) - B.get_parameter(hidden)).abs().max()) > 0.1
    C = symgraph.align(A, B, _x()).apply(B)
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-6, n
    return rep


def test_a_token_behind_a_mask_no_caller_passes_is_dead():
    torch.manual_seed(0)
    _claimed(Encoder().eval(), {"patches.token": UNPASSED}, "up.weight")


@pytest.mark.parametrize("cls", [MaskedEncoder, ForwardMaskedEncoder, EncoderOfReading])
def test_a_mask_some_caller_passes_or_a_helper_that_reads_the_token_is_not_proven(cls):
    assert closed_parameters(cls(), ["patches.token"]) == {}


def test_heads_no_constant_index_names_are_dead():
    torch.manual_seed(0)
    dead = {f"heads.{k}.{p}": INDEXED for k in (0, 1) for p in ("weight", "bias")}
    rep = _claimed(Heads().eval(), dead, "up.weight")
    assert any(("heads.2.weight", 1) in g.params and g.size == 6 for g in rep.groups)


@pytest.mark.parametrize("cls", [IteratedHeads, ZippedHeads, PickedHeads, SlicedHeads, CountedHeads, StackedHeads])
def test_heads_iterated_zipped_indexed_by_a_value_sliced_handed_on_or_of_a_list_class_are_not_proven(cls):
    assert closed_parameters(cls(), ["heads.0.weight", "heads.1.bias"]) == {}


def test_heads_reached_through_a_member_from_above_are_not_proven():
    assert closed_parameters(OuterHeads(), ["inner.heads.0.weight"]) == {}


def test_a_member_no_method_loads_is_dead_though_a_mixin_reaches_members_by_no_name():
    torch.manual_seed(0)
    _claimed(Spare().eval(), {"spare.weight": UNLOADED}, "up.weight")
    assert closed_parameters(LoadedSpare(), ["spare.weight"]) == {}
    assert closed_parameters(Chain(), ["spare.weight"]) == {}  # a Sequential's subclass runs it


def test_a_training_run_is_kept_where_what_it_leaves_unread_is_proven_dead():
    """The run reads the auxiliary head; the list's first head it leaves unread is dead (as
    RF-DETR's Group DETR runs leave its mask token): the run is kept, the head joins the class."""
    torch.manual_seed(0)
    m, x = TrainedHost().eval(), torch.randn(5, 4)
    unread = ["block.aux.weight", "block.aux.bias", "block.heads.0.weight", "block.heads.0.bias"]
    assert training_runs(m, (x,), {}, unread) == [TrainingRun("block")]
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and extra_runs(rep) == [TrainingRun("block")]
    assert set(rep.dead_parameters) == {"block.heads.0.weight", "block.heads.0.bias"}
    (hidden,) = rep.group_of("block.up.weight", 0)
    assert hidden.kind == "scaled_perm" and hidden.size == 6
    assert rep.group_of("block.aux.weight", 1) == [hidden] and rep.group_of("block.heads.1.weight", 1) == [hidden]
    assert rep.certify(m) <= 1e-6

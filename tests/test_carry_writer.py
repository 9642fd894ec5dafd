"""One writer of a moved checkpoint (issue 61, item 4): ``carry_writer`` writes B in A's basis
(``symgraph align``/``apply``) and a rotated checkpoint (``symgraph rotate``) alike; B carried
within a memory budget is written in row slices and gives the same bytes as written whole, the
alignment applied in memory."""
from __future__ import annotations

import os

import pytest
import torch

import symgraph
from symgraph.app.carry import carry_writer, piece_bytes, pieces
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.errors import InputError
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

from engine_helpers import load

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    root = tmp_path_factory.mktemp("carry")
    built = [models.build("llama", seed=s, **L) for s in range(2)]
    for i, m in enumerate(built):
        m.save_pretrained(root / f"m{i}")
    job = StreamingMerge([str(root / "m0"), str(root / "m1")])
    al = job.align()[1]
    return root, built, al


def _write(root, al, name, budget):
    os.makedirs(root / name)
    stats: dict = {}
    carry_writer(Checkpoint(str(root / "m1")), al.report_b, al.elements, al.gauge, budget=budget,
                 stats=stats)(str(root / name))
    return load(root / name), stats["bytes_held"]


def _budget(report) -> int:
    """The largest piece whose rows an element moves: the embedding and the head (vocabulary
    rows, which no element moves) are larger, and go in row slices."""
    return max(piece_bytes(report, names) for _, names, big in pieces(report)
               if report.param_shape(big)[:1] != (L["vocab"],))


def test_b_in_a_basis_within_a_budget_equals_it_whole(aligned):
    root, built, al = aligned
    whole, most = _write(root, al, "whole", None)
    assert most == max(piece_bytes(al.report_b, names) for _, names, _ in pieces(al.report_b))  # each whole
    budget = _budget(al.report_b)
    assert budget < most
    sliced, held = _write(root, al, "sliced", budget)
    assert 0 < held <= budget
    assert whole.keys() == sliced.keys() and all(torch.equal(whole[k], sliced[k]) for k in whole)
    want = al.apply(built[1], template=built[0]).state_dict()
    assert all(torch.equal(whole[k], want[k]) for k in whole)  # as the alignment applied in memory
    moved = [k for k in whole if not torch.equal(whole[k], built[1].state_dict()[k])]
    assert len(moved) > len(whole) // 2  # B really moved


def test_a_piece_whose_rows_move_is_refused_below_its_size(aligned):
    root, _, al = aligned
    with pytest.raises(InputError, match=r"--memory-budget \d+ bytes is below the \d+ bytes that moving .* needs at "
                                         r"the least while carried into A's basis; expected at least \d+") as e:
        _write(root, al, "refused", _budget(al.report_b) - 1)
    least = int(str(e.value).rsplit(" ", 1)[1])  # the least the refusal names: enough, for every piece
    assert least == _budget(al.report_b)
    assert 0 < _write(root, al, "at_least", least)[1] <= least

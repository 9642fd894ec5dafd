"""One preamble for every op-by-op run of a traced graph (activation statistics, RegMean's
Grams, Fisher's gradients, REPAIR, learned matching, the streamed outputs):
:func:`symgraph.alignment.graphrun.runnable` puts the graph on the device and refuses, as
:class:`~symgraph.errors.NeedsMemory`, constants a model traced without weights does not hold."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from symgraph.alignment.graphrun import runnable
from symgraph.errors import NeedsMemory

ROOT = pathlib.Path(__file__).resolve().parents[1] / "symgraph"


class _WithConstant(torch.nn.Module):
    def forward(self, x):
        return x + torch.tensor([1.0, 2.0])  # a tensor constant the forward creates


def test_runnable_keeps_real_constants_and_refuses_meta_ones():
    gm = torch.export.export(_WithConstant(), (torch.zeros(2),)).module()
    assert runnable(gm, "cpu") is gm
    assert torch.equal(gm(torch.zeros(2)), torch.tensor([1.0, 2.0]))
    name = next(n.target for n in gm.graph.nodes if n.op == "get_attr")
    setattr(gm, name, torch.empty(2, device="meta"))  # as a trace on meta leaves it
    with pytest.raises(NeedsMemory, match=rf"the traced graph creates tensor constants \({name}\) whose values"):
        runnable(gm, "cpu")


def test_no_other_module_repeats_the_preamble():
    callers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                     if re.search(r"\bmeta_constants\(", p.read_text()) and p.name != "graphrun.py")
    assert callers == [], callers

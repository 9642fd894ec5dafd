"""Issue 65, the detection rows of the new-tasks table: the completeness check reads a linear
op's outputs that are coordinates (a box head's boxes, returned and fed back as reference
points; the sampled positions of ``grid_sampler_2d``) as no MLP's hidden units, and a tensor the
graph reads under two names (Deformable DETR's box heads, one module per decoder layer sharing
one set of weights) as the one class the report names once. A genuinely frozen MLP is still
missing."""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from benchmarks.coverage.structure import expectations, mlp_units
from symgraph.passes.trace import trace


def mlp(*widths):
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers[:-1])


class Boxes(nn.Module):
    """Queries -> a box head (8 -> 8 -> 4, sigmoid: boxes, returned) -> the boxes embedded again
    (4 -> 16 -> 8) and added to the queries -> class logits."""

    def __init__(self):
        super().__init__()
        self.inp, self.box, self.pos, self.cls = nn.Linear(5, 8), mlp(8, 8, 4), mlp(4, 16, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        boxes = torch.sigmoid(self.box(h))
        return {"logits": self.cls(h + self.pos(boxes)), "boxes": boxes}


class Sampler(nn.Module):
    """Reference points from a linear op (8 -> 2), used as grid_sampler_2d's sampled positions."""

    def __init__(self):
        super().__init__()
        self.inp, self.ref, self.out = nn.Linear(5, 8), nn.Linear(8, 2), nn.Linear(4, 3)

    def forward(self, x, feats):
        grid = torch.tanh(self.ref(torch.relu(self.inp(x))))[:, :, None, :]
        return self.out(F.grid_sample(feats, grid, align_corners=False)[..., 0].transpose(1, 2))


class Shared(nn.Module):
    """Two box heads, one module each, sharing every weight (ties by assignment)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([mlp(8, 12, 8), mlp(8, 12, 8)])
        for a, b in zip(self.heads[0], self.heads[1]):
            if isinstance(a, nn.Linear):
                b.weight, b.bias = a.weight, a.bias

    def forward(self, x):
        return self.heads[1](self.heads[0](x) + x)


class Frozen(nn.Module):
    """An MLP whose hidden units are scaled by a constant varying along them: no map of them."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * torch.linspace(0.5, 1.5, 10, dtype=x.dtype))


def check(model, inputs, tied=()):
    model = model.double().eval()
    r = symgraph.analyze(model, inputs)
    assert r.certify(model, inputs) < 1e-12
    ep = trace(model, inputs)[0]
    return ep, expectations(ep, r, types.SimpleNamespace(), tied)


def test_boxes_returned_and_fed_back_are_no_hidden_units():
    torch.manual_seed(0)
    ep, st = check(Boxes(), (torch.randn(2, 3, 5, dtype=torch.float64),))
    ups = sorted(tuple(s) for u in mlp_units(ep) for s in u["up"])
    # the box head's and the position head's hidden units; the 4 box coordinates are none
    assert ups == [("box.0.weight", 0), ("pos.0.weight", 0)]
    assert st["mlps"] == 2 and st["missing"] == []


def test_sampled_positions_are_no_hidden_units():
    torch.manual_seed(0)
    ep, st = check(Sampler(), (torch.randn(2, 3, 5, dtype=torch.float64),
                               torch.randn(2, 4, 6, 6, dtype=torch.float64)))
    assert [tuple(s) for u in mlp_units(ep) for s in u["up"]] == [("inp.weight", 0)]
    assert st["missing"] == []


def test_a_tensor_read_under_two_names_is_one_class():
    torch.manual_seed(0)
    m = Shared()
    ep, st = check(m, (torch.randn(2, 3, 8, dtype=torch.float64),), symgraph.tied_parameters(m))
    assert st["mlps"] == 2 and st["missing"] == []
    _, untied = check(m, (torch.randn(2, 3, 8, dtype=torch.float64),))  # names unread: a miss
    assert untied["missing"] and {x["module"] for x in untied["missing"]} == {"heads.1"}


def test_a_frozen_mlp_is_still_missing():
    torch.manual_seed(0)
    _, st = check(Frozen(), (torch.randn(2, 6, dtype=torch.float64),))
    assert st["mlps"] == 1 and [x["kind"] for x in st["missing"]] == ["mlp-perm"]

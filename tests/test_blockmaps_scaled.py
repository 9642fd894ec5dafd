"""A product axis whose outer factor is a scaled or signed permutation (a ReLU's or a tanh's
channels flattened with the spatial positions into a classifier: VGG, AlexNet) is mapped as
blocks, each scaled by its factor's nonzero, never as the dense ``n×n`` matrix (VGG-11's
``512·7·7`` axis: 5 GB in float64). The blocks are the composed matrix's; the analysis
certifies and a transformed copy is recovered by weight matching.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from symgraph.core.elements import Blocks
from symgraph.passes.blockmaps import block_map

from function_helpers import assert_recovered


class Flat(nn.Module):
    """conv -> act -> pool to 3x3 -> flatten -> linear -> act -> linear."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.conv, self.fc, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 9, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.flatten(F.adaptive_avg_pool2d(self.act(self.conv(x)), (3, 3)), 1)
        return self.out(self.act(self.fc(h)))


def _x():
    return torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("act,kind", [(torch.relu, "scaled_perm"), (torch.tanh, "signed_perm")])
def test_scaled_outer_factor_is_blocks_of_the_composed_matrix(act, kind):
    model = Flat(act).eval()
    rep = symgraph.analyze(model, (_x(),))
    assert rep.certify(model, (_x(),)) <= 1e-6
    assert [(g.kind, g.size) for g in rep.groups][0] == (kind, 8)
    axis = rep.param_axes("fc.weight")[1]
    assert rep.axis_structure(axis) == ("prod", [8, 3, 3])
    scaled = 0
    for seed in range(4):
        elements = rep.random_transform(seed=seed).elements
        roots = rep._roots(elements)
        fast = block_map(rep._analysis, axis, roots)
        assert isinstance(fast, Blocks) and fast.blocks.shape == (24, 3, 3)
        slow = rep._composed_map(axis, roots, False)  # the dense route: [72, 72]
        assert torch.allclose(fast.dense(), slow, rtol=1e-15, atol=0)
        # a scaled (or signed) permutation of whole blocks: one nonzero per row
        assert bool(((slow != 0).sum(1) == 1).all())
        scaled += int(not bool((slow.abs().sum(1) == 1).all()) or bool((slow < 0).any()))
        assert rep.axis_map(axis, elements, blocks=True).__class__ is Blocks
    assert scaled >= 1  # the draws did scale (or flip) some channels


@pytest.mark.parametrize("act", [torch.relu, torch.tanh])
def test_transformed_copy_recovered_by_weights(act):
    model, x = Flat(act).eval(), _x()
    rep = symgraph.analyze(model, (x,))
    moved = symgraph.transform(model, rep.random_transform(seed=5, orthogonal=True))
    with torch.no_grad():
        assert torch.allclose(moved(x), model(x), atol=1e-6)
    assert not torch.equal(moved.fc.weight, model.fc.weight)
    assert_recovered(model, moved, (x,))

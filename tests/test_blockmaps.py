"""The head axes' maps built as blocks (:mod:`symgraph.passes.blockmaps`) are the composed
matrix's, bit for bit: the same index vector or the same blocks (signed zeros included)."""
import pytest
import torch

import symgraph
from symgraph.core.elements import Blocks
from symgraph.passes.blockmaps import block_map
from symgraph.testing import models


def _bits(x):
    return x.view(torch.int64) if x.dtype == torch.float64 else x


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "vit", "phi", "gptj", "neox", "mixtral"])
def test_block_maps_are_the_composed_maps(arch):
    model = models.build(arch)
    rep = symgraph.analyze(model)
    built = blocks = 0
    for seed, orthogonal in ((0, False), (1, True), (2, False)):
        elements = rep.random_transform(seed=seed, orthogonal=orthogonal).elements
        for name, _ in model.named_parameters():
            for axis in rep.param_axes(name):
                fast = block_map(rep._analysis, axis, rep._roots(elements))
                if fast is None:
                    continue
                slow = rep._composed_map(axis, rep._roots(elements), True)  # the dense route
                assert isinstance(fast, Blocks) == isinstance(slow, Blocks), (name, axis)
                if isinstance(fast, Blocks):
                    assert torch.equal(fast.index, slow.index), (name, axis)
                    assert fast.blocks.dtype == slow.blocks.dtype
                    assert torch.equal(_bits(fast.blocks), _bits(slow.blocks)), (name, axis)
                    blocks += 1
                else:
                    assert torch.equal(fast, slow), (name, axis)
                assert rep.axis_map(axis, elements, blocks=True).__class__ is fast.__class__
                built += 1
    assert built >= 3 and blocks >= 1, (built, blocks)  # every family has head axes of this form

"""The head axes' maps built as blocks (:mod:`symgraph.passes.blockmaps`) are the composed
matrix's, bit for bit: the same index vector or the same blocks (signed zeros included)."""
import math

import pytest
import torch

import symgraph
from symgraph.core.elements import Blocks, is_perm
from symgraph.passes.axes import axis_matrix
from symgraph.passes.blockmaps import block_map
from symgraph.testing import models


def _composed(rep, axis, elements):
    """``axis_map(blocks=True)`` through the dense composed matrix (the path before blockmaps)."""
    M = axis_matrix(rep._analysis, axis, rep._roots(elements))
    if M is None or M.dim() != 2 or M.shape[0] != M.shape[1]:
        return M
    if is_perm(M):
        return M.argmax(1)
    st = rep.axis_structure(axis)
    if st is not None and st[0] == "prod":
        M = Blocks.of(M, [math.prod(st[1][j:]) for j in range(len(st[1]) - 1, 0, -1)]) or M
    return M


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
                st = rep.axis_structure(axis)
                fast = None if st is None else block_map(rep._analysis, axis, rep._roots(elements), st[1])
                if fast is None:
                    continue
                slow = _composed(rep, axis, elements)
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

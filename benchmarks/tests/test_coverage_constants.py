"""The completeness check's constants (``benchmarks.coverage.graph.is_constant``): each node's
answer is kept per program, so a chain whose every step reads the last two values (a residual
quantizer's 32 subtractions) is answered in linear time, not by walking every path (~1.6^depth)."""
from __future__ import annotations

import time

import torch

from benchmarks.coverage.graph import is_constant


class Chain(torch.nn.Module):
    def __init__(self, depth: int = 30):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.depth = depth

    def forward(self, x):
        a, b = self.w * 2, self.w + 1  # parameters only
        y, z = x, x + 1  # activations
        for _ in range(self.depth):
            a, b = b, a - b * 0.5
            y, z = z, y - z * 0.5
        return a + 0 * b, y + 0 * z


def test_a_deep_chain_is_answered_fast_and_right():
    ep = torch.export.export(Chain(), (torch.randn(3),))
    out = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    t = time.perf_counter()
    assert is_constant(ep, out[0]) and not is_constant(ep, out[1])
    assert time.perf_counter() - t < 5.0

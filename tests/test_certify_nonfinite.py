"""The certificate never passes a transform because a comparison skipped a NaN: outputs that
become NaN (or gain or move an infinity) fail it; an infinity kept in place (a logit masked to
``-inf``) is kept, and the finite values are what is compared."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.errors import CertificationError
from symgraph.report.certify import deviation


def test_deviation_of_non_finite_values():
    a = torch.tensor([1.0, -math.inf, 2.0])
    assert deviation([a], [a.clone()]) == 0.0
    assert deviation([a], [torch.tensor([1.0, -math.inf, 2.5])]) == pytest.approx(0.5 / math.sqrt(5))
    for b in (torch.tensor([1.0, math.nan, 2.0]), torch.tensor([-math.inf, 1.0, 2.0]),
              torch.tensor([1.0, math.inf, 2.0]), torch.tensor([math.nan] * 3)):
        assert deviation([a], [b]) == math.inf
    nan = torch.tensor([math.nan, 1.0])
    assert deviation([nan], [nan.clone()]) == math.inf  # NaN on the example inputs certifies nothing


class Masked(nn.Module):
    """An MLP whose first output is masked to -inf, as a vocabulary mask would."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        return y.masked_fill(torch.tensor([True, False, False]), -math.inf)


def test_masked_output_certifies_and_a_nan_transform_fails(monkeypatch):
    torch.manual_seed(0)
    m = Masked().double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    report = symgraph.analyze(m, (x,))
    assert report.certify(m, (x,)) < 1e-12  # the -inf kept in place, the rest compared
    apply = importlib.import_module("symgraph.transform.apply")

    def poisoned(model, t):  # a "transform" whose model computes NaN
        out = original(model, t)
        with torch.no_grad():
            out.down.bias[1] = math.nan
        return out
    original = apply.transform
    monkeypatch.setattr(apply, "transform", poisoned)
    with pytest.raises(CertificationError, match="differ by inf"):
        report.certify(m, (x,))

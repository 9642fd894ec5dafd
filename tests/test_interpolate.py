"""``symgraph.interpolate`` and ``loss_barrier`` in memory: every parameter and floating-point
buffer moves along the line (λ = 0 is B, λ = 1 is A), and bad arguments are refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import symgraph
from symgraph.errors import InputError

X = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def bn_net(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4)).eval()
    with torch.no_grad():  # trained running statistics: not the defaults both models share
        m[1].running_mean.normal_(0, 1)
        m[1].running_var.uniform_(0.5, 2.0)
    m[1].num_batches_tracked.fill_(seed + 3)
    return m


def loss(m):
    with torch.no_grad():
        return float(m(X).square().mean())


def test_the_ends_are_the_models_running_statistics_included():
    a, b = bn_net(0), bn_net(1)
    curve = dict(symgraph.interpolate(a, b, [0.0, 0.5, 1.0], loss))
    assert curve[0.0] == pytest.approx(loss(b), rel=1e-6) and curve[1.0] == pytest.approx(loss(a), rel=1e-6)
    assert loss(a) != pytest.approx(loss(b), rel=1e-2)  # the test can tell the ends apart
    mid = symgraph.interpolate(a, b, [0.5], lambda m: float(m[1].running_var.sum()))[0][1]
    assert mid == pytest.approx(float((a[1].running_var + b[1].running_var).sum() / 2), rel=1e-6)
    assert int(a[1].num_batches_tracked) == 3  # inputs untouched


@pytest.mark.parametrize("lambdas, says", [([2.0], "2.0 is not"), ([], "non-empty"), ([float("nan")], "nan is not"),
                                           (0.5, "expected a sequence"), ("abc", "expected a sequence")])
def test_lambdas_outside_the_segment_are_refused(lambdas, says):
    with pytest.raises(InputError, match=says):
        symgraph.interpolate(bn_net(0), bn_net(1), lambdas, loss)


def test_a_loss_that_is_not_one_finite_number_is_refused():
    a, b = bn_net(0), bn_net(1)
    with pytest.raises(InputError, match="expected one number"):
        symgraph.interpolate(a, b, [0.5], lambda m: m(X).mean(0))
    with pytest.raises(InputError, match="expected a finite loss"):
        symgraph.interpolate(a, b, [0.5], lambda m: float("nan"))
    with pytest.raises(InputError, match="loss_fn is int"):
        symgraph.interpolate(a, b, [0.5], 3)


def test_models_with_other_tensors_are_refused_either_way():
    a, b = bn_net(0), bn_net(1)
    b.add_module("extra", nn.Linear(2, 2))
    with pytest.raises(InputError, match="only B has it"):
        symgraph.interpolate(a, b, [0.5], loss)
    with pytest.raises(InputError, match="only A has it"):
        symgraph.interpolate(b, a, [0.5], loss)
    with pytest.raises(InputError, match="a is a str"):
        symgraph.interpolate("x", a, [0.5], loss)


@pytest.mark.parametrize("curve", [[1, 2], None, [(0.0, 1.0), (1.0, float("nan"))]])
def test_loss_barrier_refuses_what_is_not_a_curve(curve):
    with pytest.raises(InputError, match="loss_barrier"):
        symgraph.loss_barrier(curve)


def test_loss_barrier_of_a_curve():
    assert symgraph.loss_barrier([(1.0, 1.0), (0.0, 3.0), (0.5, 4.0)]) == pytest.approx(2.0)
    assert np.isfinite(symgraph.loss_barrier(symgraph.interpolate(bn_net(0), bn_net(1), [0.0, 1.0], loss)))

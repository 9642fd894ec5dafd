"""Helpers of the REPAIR tests (``test_repair*.py``): one intra-op thread, per-channel moments."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    yield
    torch.set_num_threads(n)


def moments(x):
    mean = x.mean(0)
    return mean, (x * x).mean(0).sub(mean * mean).clamp_min(0).sqrt(), (x * x).mean(0).sqrt()


class ReadsStatistics(torch.nn.Module):
    """A BatchNorm layer whose running statistics the forward reads by hand (no batch-norm op)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return (self.lin(x) - self.bn.running_mean) / self.bn.running_var.sqrt()

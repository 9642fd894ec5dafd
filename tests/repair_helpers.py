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

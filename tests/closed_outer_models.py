"""A model around tests/closed_list_models.py's heads, in a file of its own: its method reaches
a head through its member (``self.inner.heads[0]``), a load of the list on another object,
which the static check of ``symgraph.passes.closed_reads`` must refuse wherever it is written."""
from __future__ import annotations

import torch
import torch.nn as nn

from closed_list_models import Heads


class OuterHeads(nn.Module):
    """A model around the heads whose method reaches the first head through its member."""

    def __init__(self):
        super().__init__()
        self.inner = Heads()

    def forward(self, x: torch.Tensor):
        return self.inner(x)

    def first(self, h):
        return self.inner.heads[0](h)

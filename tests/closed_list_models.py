"""Tiny models for tests/test_closed_lists.py: embeddings that swap in a learned token only when
handed a mask, which no caller passes (as RF-DETR calls its Dinov2 embeddings); a list of heads
of which only one is indexed (as PP-DocLayoutV4's decoder reads its last class head); a member
no method loads, its holder reaching members by no name in a mixin. Variants the static check
of ``symgraph.passes.closed_reads`` must refuse. Attribute names are in no string of this file
but its docstrings, as that check requires."""
from __future__ import annotations

import torch
import torch.nn as nn

from closed_mixin import FreezeMixin


class Patches(nn.Module):
    """A projection plus a position vector (a helper method's); the token swapped in only where a
    mask is handed and a flag no class sets is true."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.token = nn.Parameter(torch.zeros(6))
        self.pos = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        h = self.proj(x)
        if mask is not None and self.use_token:
            h = torch.where(mask.unsqueeze(-1), self.token, h)
        return h + self.shifted()

    def shifted(self):
        return self.pos * 0.5


class Encoder(nn.Module):
    """Calls its embeddings without a mask, then an MLP."""

    def __init__(self):
        super().__init__()
        self.patches = Patches()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor):
        return self.down(torch.relu(self.up(self.patches(x))))


class MaskedEncoder(Encoder):
    """The same, and a method that hands the embeddings a mask."""

    def masked(self, x, m):
        return self.patches(x, m)


class ReadingPatches(Patches):
    """Embeddings whose helper method reads the token."""

    def shifted(self):
        return self.pos + self.token


class EncoderOfReading(Encoder):
    """An encoder whose embeddings' helper reads the token."""

    def __init__(self):
        super().__init__()
        self.patches = ReadingPatches()


class Heads(nn.Module):
    """An MLP, then the last of a list of heads (twice, by two constants)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 3) for _ in range(3)])

    def forward(self, x: torch.Tensor):
        h = self.down(torch.relu(self.up(x)))
        return self.heads[-1](h) + self.heads[2](h)


class IteratedHeads(Heads):
    """The same, and a method iterating the heads."""

    def every(self, h):
        return [m(h) for m in self.heads]


class ZippedHeads(Heads):
    """The same, and a method zipping the heads with inputs."""

    def each(self, hs):
        return [m(h) for m, h in zip(self.heads, hs)]


class PickedHeads(Heads):
    """The same, and a method indexing the heads by an argument."""

    def pick(self, h, i):
        return self.heads[i](h)


class SlicedHeads(Heads):
    """The same, and a method slicing the heads."""

    def rest(self, h):
        return self.heads[1:][0](h)


class CountedHeads(Heads):
    """The same, and a method counting the heads (the list handed on)."""

    def count(self):
        return len(self.heads)


class Spare(FreezeMixin, nn.Module):
    """An MLP holding an embedding that no method loads; its mixin (another file) reaches every
    parameter by no name."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Embedding(2, 4)
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor):
        return self.down(torch.relu(self.up(x)))


class LoadedSpare(Spare):
    """The same, and a method that loads the embedding."""

    def rows(self):
        return self.spare.weight.shape[0]


class TrainedHeads(nn.Module):
    """An MLP whose auxiliary head is read only in training mode, then the last of its heads."""

    def __init__(self):
        super().__init__()
        self.up, self.aux = nn.Linear(4, 6), nn.Linear(6, 2)
        self.heads = nn.ModuleList([nn.Linear(6, 3) for _ in range(2)])

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.training:
            return self.heads[-1](h), self.aux(h)
        return self.heads[-1](h), None


class TrainedHost(nn.Module):
    """Keeps its block's first result."""

    def __init__(self):
        super().__init__()
        self.block = TrainedHeads()

    def forward(self, x: torch.Tensor):
        return self.block(x)[0]


class ForwardMaskedEncoder(Encoder):
    """The same encoder, and a method that hands the embeddings' forward a mask."""

    def masked(self, x, m):
        return self.patches.forward(x, m)


class Chain(nn.Sequential):
    """Layers run in turn by torch's own forward, the second one assigned by name."""

    def __init__(self):
        super().__init__(nn.Linear(4, 4))
        self.spare = nn.Linear(4, 4)


class StackedHeads(Heads):
    """The same, its heads a list of its own class, which may index its own way."""

    def __init__(self):
        super().__init__()
        self.heads = Stack([nn.Linear(6, 3) for _ in range(3)])


class Stack(nn.ModuleList):
    """A list whose item at any index is its last."""

    def __getitem__(self, i):
        return super().__getitem__(len(self) - 1 if isinstance(i, int) else i)

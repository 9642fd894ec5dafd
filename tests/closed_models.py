"""Tiny models for tests/test_closed_reads.py: a block that embeds token ids only when it is
handed no embeddings, called by its parent always with them (as PI0 calls its action model), and
variants the static check of ``symgraph.passes.closed_reads`` must refuse. The block's attribute
names are in no string of this file but its docstrings, as that check requires."""
from __future__ import annotations

import torch
import torch.nn as nn

from closed_mixin import DecodeMixin


class Block(nn.Module):
    """An MLP over embeddings, its token ids embedded only when it is given none."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 6)
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, ids=None, embeds: torch.Tensor | None = None):
        if embeds is None:
            embeds = self.table(ids)
        return self.down(torch.relu(self.up(embeds)))


class Pilot(nn.Module):
    """A projection whose result the block always gets as its embeddings."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.block = Block()

    def forward(self, x: torch.Tensor):
        return self.run(self.proj(x))

    def run(self, h: torch.Tensor):
        return self.block(embeds=h)


class MaybeNone(Pilot):
    """The same, the block's embeddings an optional argument: None may reach it."""

    def run(self, h: torch.Tensor | None = None):
        return self.block(embeds=h)


class Tokens(Pilot):
    """The same, and a method that hands the block token ids."""

    def tokens(self, ids):
        return self.block(ids)


class Reached(Pilot):
    """The same, and a method that reaches the block's table by name."""

    def rows(self):
        return self.block.table.weight.shape


class Reassigned(Block):
    """A block that replaces its embeddings before the test: they may be None there."""

    def forward(self, ids=None, embeds: torch.Tensor | None = None):
        embeds = embeds if ids is None else None
        if embeds is None:
            embeds = self.table(ids)
        return self.down(torch.relu(self.up(embeds)))


class PilotOfReassigned(Pilot):
    """A pilot whose block replaces its embeddings."""

    def __init__(self):
        super().__init__()
        self.block = Reassigned()


class Tower(nn.Module):
    """An MLP holding a marker embedding that no method of it loads by name."""

    def __init__(self):
        super().__init__()
        self.marker = nn.Embedding(2, 6)
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

    def kept(self, n):
        return n - n // 4

    def freeze(self):
        for p in self.parameters():  # reaches members by no name: the proof of deadcode stops here
            p.requires_grad_(False)


class Host(nn.Module):
    """Calls its tower and a method of it, then a head."""

    def __init__(self):
        super().__init__()
        self.tower, self.head = Tower(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor):
        n = self.tower.kept(x.shape[0])
        return self.head(self.tower(x)[:n])


class MarkedTower(Tower):
    """The same tower, with a method that loads its marker."""

    def kept(self, n):
        return n - int(self.marker.weight.shape[0])


class MarkedHost(Host):
    """A host whose tower's method loads the marker."""

    def __init__(self):
        super().__init__()
        self.tower = MarkedTower()


class NamedHost(Host):
    """A host that also reaches its tower by a name it computes."""

    def pick(self, which):
        return getattr(self, f"to{which}")


class DecodingTower(Tower):
    """A tower whose decoding method, which its host never calls, loads the marker."""

    def decode(self, ids):
        return self.marker(ids)


class DecodingHost(Host):
    def __init__(self):
        super().__init__()
        self.tower = DecodingTower()


class Wrapped(nn.Module):
    """A model around the host."""

    def __init__(self):
        super().__init__()
        self.host = DecodingHost()

    def forward(self, x: torch.Tensor):
        return self.host(x)


class WrappedWithMixin(Wrapped, DecodeMixin):
    """The same model, with a mixin (another file) that decodes through the tower's method."""


class ProbedHost(Host):
    """A host with a probe that only a public method of it reads (an entry point), beside its
    tower's marker that no way in loads."""

    def __init__(self):
        super().__init__()
        self.probe = nn.Linear(6, 2)

    def predict_probe(self, x: torch.Tensor):
        return self.probe(self.tower(x))

"""Tiny models for tests/test_dead_parameters.py: a linear layer and a vector their forward never
reads, read by another method, by a computed name, or a list item never run. Their names are in
no string of this file, as the static check of ``symgraph.passes.deadcode`` requires."""
from __future__ import annotations

import torch
import torch.nn as nn


class DeadMLP(nn.Module):
    """An MLP holding a linear layer and a vector that no method reads."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)
        self.spare = nn.Linear(16, 16)
        self.sep = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ReadElsewhere(DeadMLP):
    """The same layer and vector, read by a method the forward does not call."""

    def predict(self, x):
        return self.spare(torch.relu(self.up(x))) + self.sep


class ReadByName(DeadMLP):
    """The same layer and vector, reached by a name computed at run time."""

    def pick(self, which):
        return getattr(self, f"sp{which}")


class Blocks(nn.Module):
    """A list of layers of which the forward runs only the first."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 16)])
        self.down = nn.Linear(16, 3)

    def forward(self, x):
        return self.down(torch.relu(self.blocks[0](x)))


class Stack(nn.ModuleList):
    """A list of the model's own class: its items are reached by iteration."""


class Scaled(nn.Linear):
    """A torch layer subclassed: torch's own forward reads its parameters by name."""


class Handed(DeadMLP):
    """The same layer and vector, reached by a function ``self`` is handed to."""

    def visit(self, fn):
        return fn(self)



def plain(module):
    """Asks what ``module`` is, and reaches none of its members."""
    return isinstance(module, nn.Sequential)


def walks(module):
    """Reaches every member of ``module``."""
    return list(module.children())


class Shelved(nn.Module):
    """An MLP holding a block its forward never calls (whose own forward reads its layer), and
    handing ``self`` to a function that only asks what it is."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)
        self.shelf = Blocks()

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h) if not plain(self) else h


class Walked(Shelved):
    """The same, but ``self`` also goes to a function that reaches every member."""

    def visit(self):
        return walks(self)


class Hooked(nn.Module):
    """A layer its forward never runs, which a hook of another class may read."""

    def __init__(self):
        super().__init__()
        self.up, self.extra = nn.Linear(6, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.up(x)


class Hooker(nn.Module):
    """A hook whose own ``self`` is the module it is put on (any: a ``Hooked`` too)."""

    def hook(self):
        def read(self, inputs, output):
            return self.extra(output)
        return read


class Shadowed(Shelved):
    """The same, but the name of the harmless function is bound again inside a method: the call
    ``plain(self)`` there reaches whatever that name holds."""

    def visit(self, plain):
        return plain(self)


class Strided(nn.Module):
    """A block applying its second layer only at stride 1 (PP-LCNetV3's rep layer skips its
    activation block at stride 2); its one string holds that layer's name only inside another
    word."""

    def __init__(self, stride):
        super().__init__()
        self.stride = stride
        self.conv, self.gate = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        x = self.conv(x)
        if self.stride != 2:
            x = self.gate(x)
        return x

    def extra_repr(self):
        return "gate_count=1"


class Restrided(Strided):
    """The same block, its stride changed after ``__init__``: the branch proves nothing."""

    def halve(self):
        self.stride = 1


class TrainOnly(Strided):
    """The second layer run only in training: ``train()`` sets what the branch reads."""

    def forward(self, x):
        x = self.conv(x)
        if self.training:
            x = self.gate(x)
        return x

"""A buffer viewed or cropped before it is added to activations moves with the class it is added
to (``symgraph.passes.bufferviews``: SD3's cropped position table); a view of a buffer read by
anything else stays fixed, as a buffer read that way directly does."""
from __future__ import annotations

import torch

import symgraph


class Cropped(torch.nn.Module):
    """Tokens plus a table of positions stored as a flat 4 x 4 grid, cropped to the tokens."""

    def __init__(self, matmul: bool = False):
        super().__init__()
        self.inp, self.out, self.matmul = torch.nn.Linear(3, 8), torch.nn.Linear(8, 2), matmul
        self.register_buffer("pos", torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):  # x: [batch, 4 tokens, 3]
        grid = self.pos.view(1, 4, 4, 8)[:, :2, :2, :].reshape(1, 4, 8)
        h = self.inp(x)
        h = h @ grid[0].T @ grid[0] if self.matmul else h + grid
        return self.out(torch.relu(h))


def _model(matmul=False):
    torch.manual_seed(0)
    return Cropped(matmul).double().eval(), (torch.randn(2, 4, 3, dtype=torch.float64),)


def test_cropped_buffer_moves_with_the_hidden_class():
    m, x = _model()
    r = symgraph.analyze(m, x)
    assert r.fixed_buffers == {} and r.buffers == ["pos"]
    (hidden,) = r.group_of("inp.weight", 0)
    assert hidden.kind == "scaled_perm" and ("pos", 2) in hidden.buffers and ("out.weight", 1) in hidden.params
    assert r.certify(m, x) < 1e-12
    t = r.random_transform(seed=0)
    moved = symgraph.transform(m, t)
    assert not torch.allclose(moved.pos, m.pos)  # the table took the permutation and scales
    assert torch.allclose(moved(*x), m(*x), atol=1e-12)


def test_buffer_view_read_by_a_matmul_stays_fixed():
    m, x = _model(matmul=True)
    r = symgraph.analyze(m, x)
    assert list(r.fixed_buffers) == ["pos"] and r.buffers == []
    assert r.certify(m, x) < 1e-12
    moved = symgraph.transform(m, r.random_transform(seed=0))
    assert torch.equal(moved.pos, m.pos)


class Offsets(torch.nn.Module):
    """A float table and an integer offset, each viewed before it is added."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(1, 8))
        self.register_buffer("offset", torch.arange(4))

    def forward(self, x, ids):
        return x + self.table.view(2, 4)[:1], ids + self.offset.view(1, 4)


def test_only_floating_buffers_chains_take_rules():
    from symgraph.passes.bufferviews import buffer_views
    ep = torch.export.export(Offsets(), (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.long)), strict=False)
    found = buffer_views(ep.graph, dict(ep.graph_signature.inputs_to_buffers))
    reads = {n.args[0].name for n in found if n.args[0].op == "placeholder"}
    assert reads == {"b_table"} and len(found) == 2  # the view and the slice of the table

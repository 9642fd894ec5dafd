"""GroupNorm (issue 65): channels in G contiguous groups are the product ``groups ×
per_group``; whole groups are permuted and, inside each group, its channels by a permutation of
their own (perm(G) ≀ perm(C/G)), gains and biases moving with the channels. Checked on tricky
shapes (one group, one channel per group, 1-D and 0-D spatial inputs, no affine parameters,
groups crossing a grouped convolution's), certified in float64 and recovered by weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph
from symgraph.testing.models import randomized as shared_randomized

CERT = 1e-12



def randomized(model, seed=0):
    return shared_randomized(model, seed, scale=0.5)


class Net(nn.Module):
    """conv (or linear) -> GroupNorm -> silu -> conv (or linear) -> mean -> linear."""

    def __init__(self, groups, channels, spatial=2, affine=True):
        super().__init__()
        conv = {0: lambda i, o, k: nn.Linear(i, o), 1: nn.Conv1d, 2: nn.Conv2d}[spatial]
        self.spatial = spatial
        self.c1, self.c2 = conv(3, channels, 3), conv(channels, 5, 3)
        self.gn = nn.GroupNorm(groups, channels, affine=affine)
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        h = self.c2(F.silu(self.gn(self.c1(x))))
        return self.fc(h.mean(dim=tuple(range(2, 2 + self.spatial))) if self.spatial else h)


def image(spatial):
    shape = (2, 3) + (7,) * spatial if spatial else (2, 3)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def groups_of(report, param, dim):
    return {g.id: g for g in report.group_of(param, dim)}


@pytest.mark.parametrize("groups,channels,spatial,affine", [
    (3, 12, 2, True), (4, 8, 1, True), (2, 6, 0, True), (1, 6, 2, True), (6, 6, 2, True),
    (3, 9, 2, False)],
    ids=["3x4_2d", "4x2_1d", "2x3_0d", "one_group", "one_per_group", "no_affine"])
def test_group_norm_mapping(groups, channels, spatial, affine):
    m, x = randomized(Net(groups, channels, spatial, affine)), image(spatial)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < CERT
    per = channels // groups
    axis = r.param_axes("c1.weight")[0]
    st = r.axis_structure(axis)
    assert st == (("prod", [groups, per]) if 1 < groups < channels else None)
    found = groups_of(r, "c1.weight", 0)
    slots = {("c1.weight", 0), ("c1.bias", 0), ("c2.weight", 1)}
    if affine:
        slots |= {("gn.weight", 0), ("gn.bias", 0)}
    for g in found.values():
        assert g.kind == "perm" and slots <= set(g.params)
    inner = [g for g in found.values() if g.size == channels and g.blocks == groups and groups > 1
             and groups < channels]
    if 1 < groups < channels:  # one permutation of the groups and one inside each group
        assert sorted((g.size, g.blocks) for g in found.values()) == [(groups, 1), (channels, groups)]
        (inner,) = inner
        assert r.fibre_shape(inner.id) == (groups,)
    else:
        assert [(g.size, g.blocks) for g in found.values()] == [(channels, 1)]
    # the exact map: a transformed copy moves every slot of the channels by one index vector,
    # which keeps each group's channels together and permutes inside groups independently
    for seed in range(4):
        t = r.random_transform(seed=seed)
        moved = symgraph.transform(m, t)
        idx = r.axis_map(axis, t.elements, blocks=True)
        assert idx.shape == (channels,) and sorted(idx.tolist()) == list(range(channels))
        blocks = idx.view(groups, per)
        assert all(len({int(i) // per for i in row}) == 1 for row in blocks)
        assert torch.equal(moved.c1.weight, m.c1.weight[idx])
        out = r.axis_map(r.param_axes("c2.weight")[0], t.elements)  # c2's outputs: their own class
        want = torch.einsum("ab,b...->a...", out, m.c2.weight[:, idx]) if out is not None else m.c2.weight[:, idx]
        assert torch.allclose(moved.c2.weight, want, atol=1e-12, rtol=0)
        if affine:
            assert torch.equal(moved.gn.weight, m.gn.weight[idx]) and torch.equal(moved.gn.bias, m.gn.bias[idx])
    if inner:  # the permutations inside the groups differ between groups for some seed
        inside = [[tuple((r.axis_map(axis, r.random_transform(seed=s).elements, blocks=True)
                          .view(groups, per) % per)[k].tolist()) for k in range(groups)] for s in range(6)]
        assert any(len(set(rows)) > 1 for rows in inside)


class Crossed(nn.Module):
    """GroupNorm in 4 groups of 3, read by a convolution in 3 groups of 4: the structures cross."""

    def __init__(self):
        super().__init__()
        self.c1, self.gn = nn.Conv2d(3, 12, 1), nn.GroupNorm(4, 12)
        self.c2, self.fc = nn.Conv2d(12, 6, 3, groups=3), nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(self.c2(F.silu(self.gn(self.c1(x)))).mean(dim=(2, 3)))


def test_group_norm_crossing_a_grouped_convolution_is_fixed():
    m, x = randomized(Crossed()), image(2)
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < CERT
    assert r.group_of("c1.weight", 0) == [] and r.group_of("gn.weight", 0) == []


class TinyUNetBlock(nn.Module):
    """A ResNet block as diffusion U-Nets write it: GroupNorm -> silu -> conv, twice, a skip,
    a time embedding added per channel."""

    def __init__(self, c=8, groups=2, t=6):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.n1, self.c1 = nn.GroupNorm(groups, c), nn.Conv2d(c, 2 * c, 3, padding=1)
        self.temb = nn.Linear(t, 2 * c)
        self.n2, self.c2 = nn.GroupNorm(2 * groups, 2 * c), nn.Conv2d(2 * c, c, 3, padding=1)
        self.out_norm, self.head = nn.GroupNorm(groups, c), nn.Conv2d(c, 3, 1)

    def forward(self, x, t):
        h = self.stem(x)
        r = self.c1(F.silu(self.n1(h))) + self.temb(F.silu(t))[:, :, None, None]
        h = h + self.c2(F.silu(self.n2(r)))
        return self.head(F.silu(self.out_norm(h)))


def test_group_norm_resnet_block_certified_and_recovered():
    m = randomized(TinyUNetBlock())
    x = (image(2), torch.randn(2, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < CERT
    stream = groups_of(r, "stem.weight", 0)  # the skip: 2 groups of 4 channels
    assert sorted((g.size, g.blocks) for g in stream.values()) == [(2, 1), (8, 2)]
    assert all({("n1.weight", 0), ("out_norm.bias", 0), ("c2.weight", 0), ("head.weight", 1)}
               <= set(g.params) for g in stream.values())
    hidden = groups_of(r, "c1.weight", 0)  # 4 groups of 4, the time embedding's outputs too
    assert sorted((g.size, g.blocks) for g in hidden.values()) == [(4, 1), (16, 4)]
    assert all(("temb.weight", 0) in g.params for g in hidden.values())
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved, x)
    got, want, was = al.apply(moved).state_dict(), m.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6

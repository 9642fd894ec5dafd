"""Issue 69 (timm's byoanet, ``halonet_h1``): halo attention with relative position logits,
BatchNorm and SiLU. Its row certified anywhere from 1e-10 to 2.9e-6 with the same classes.
Each class is exact: the random draw made the model amplify round-off (attention logits of
1e6..1e7, so a change of one ulp in the input moves the output as much as the symmetry does);
the same model with smaller BatchNorm gains certifies at 1e-16. This is the pattern in plain
torch: its classes, and a certificate at float64 round-off over several draws."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph


def rel_logits_1d(q, rel_k, permute_mask):
    """Relative logits along one axis, written as timm writes them (pad, flatten, re-slice)."""
    B, H, W, _ = q.shape
    rel_size = rel_k.shape[0]
    win = (rel_size + 1) // 2
    x = (q @ rel_k.transpose(-1, -2)).reshape(-1, W, rel_size)
    x = F.pad(F.pad(x, [0, 1]).flatten(1), [0, rel_size - W]).reshape(-1, W + 1, rel_size)
    x = x[:, :W, win - 1:].reshape(B, H, 1, W, win).expand(-1, -1, win, -1, -1)
    return x.permute(permute_mask)


class Halo(nn.Module):
    """Halo attention: queries in blocks, keys and values in overlapping windows around them,
    relative position logits added before the softmax (Vaswani et al., 2021)."""

    def __init__(self, dim=16, heads=2, block=4, halo=1):
        super().__init__()
        self.heads, self.dh, self.block, self.halo = heads, dim // heads, block, halo
        self.win = block + 2 * halo
        self.q = nn.Conv2d(dim, dim, 1, bias=False)
        self.kv = nn.Conv2d(dim, 2 * dim, 1, bias=False)
        self.height_rel = nn.Parameter(torch.randn(2 * self.win - 1, self.dh) * self.dh ** -0.5)
        self.width_rel = nn.Parameter(torch.randn(2 * self.win - 1, self.dh) * self.dh ** -0.5)

    def pos(self, q):
        B, BB, HW, _ = q.shape
        q = q.reshape(-1, self.block, self.block, self.dh)
        w = rel_logits_1d(q, self.width_rel, (0, 1, 3, 2, 4))
        h = rel_logits_1d(q.transpose(1, 2), self.height_rel, (0, 3, 1, 4, 2))
        return (h + w).reshape(B, BB, HW, -1)

    def forward(self, x):
        B, C, H, W = x.shape
        nh, nw, bs, dh = H // self.block, W // self.block, self.block, self.dh
        q = self.q(x).reshape(-1, dh, nh, bs, nw, bs).permute(0, 1, 3, 5, 2, 4)
        q = q.reshape(B * self.heads, dh, -1, nh * nw).transpose(1, 3)
        kv = F.pad(self.kv(x), [self.halo] * 4)
        kv = kv.unfold(2, self.win, bs).unfold(3, self.win, bs)
        kv = kv.reshape(B * self.heads, 2 * dh, nh * nw, -1).permute(0, 2, 3, 1)
        k, v = torch.split(kv, [dh, dh], dim=-1)
        attn = ((q @ k.transpose(-1, -2)) * dh ** -0.5 + self.pos(q)).softmax(dim=-1)
        out = (attn @ v).transpose(1, 3).reshape(-1, bs, bs, nh, nw)
        return out.permute(0, 3, 1, 4, 2).contiguous().view(B, C, H, W)


class HaloNet(nn.Module):
    """A stem, one self-attention bottleneck (1x1 conv, BN, SiLU, halo attention, BN, SiLU,
    1x1 conv, BN, residual), a pooled linear head."""

    def __init__(self, dim=16, mid=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 3, padding=1), nn.BatchNorm2d(dim), nn.SiLU())
        self.conv1 = nn.Sequential(nn.Conv2d(dim, mid, 1), nn.BatchNorm2d(mid), nn.SiLU())
        self.attn = Halo(mid)
        self.post = nn.BatchNorm2d(mid)
        self.conv3 = nn.Sequential(nn.Conv2d(mid, dim, 1), nn.BatchNorm2d(dim))
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        x = self.stem(x)
        y = self.conv3(F.silu(self.post(self.attn(self.conv1(x)))))
        return self.head(F.silu(x + y).mean((2, 3)))


def _build(seed, gain=1.0):
    torch.manual_seed(seed)
    m = HaloNet()
    with torch.no_grad():  # nothing constant: a constant hides a wrong slot from the certificate
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.copy_(gain * (1 + 0.5 * torch.randn(mod.weight.shape)))
                mod.bias.copy_(gain * 0.5 * torch.randn(mod.bias.shape))
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 1.5)
    return m.eval(), torch.randn(1, 3, 8, 8)


def _with(report, *slots, blocks=1):
    hit = [g for g in report.groups if set(slots) <= set(g.params) and g.blocks == blocks]
    assert len(hit) == 1, [(g.kind, g.params) for g in report.groups]
    return hit[0]


@pytest.fixture(scope="module")
def report():
    m, x = _build(0)
    return symgraph.analyze(m, (x,))


def test_halo_attention_classes(report):
    # the query-key width of a head: one invertible map, the relative position tables on the key side
    qk = _with(report, ("attn.q.weight", 0), ("attn.kv.weight", 0), ("attn.height_rel", 1),
               ("attn.width_rel", 1))
    assert qk.kind == "gl" and qk.dim == 8
    assert qk.variance[qk.params.index(("attn.q.weight", 0))] != \
        qk.variance[qk.params.index(("attn.height_rel", 1))]
    # the heads: one permutation of query, key, value and output blocks together
    heads = _with(report, ("attn.q.weight", 0), ("attn.kv.weight", 0), ("post.weight", 0))
    assert heads.kind == "perm" and heads.size == 2
    # the value width within each head, through the BatchNorm and SiLU after the attention
    v = _with(report, ("attn.kv.weight", 0), ("post.weight", 0), ("conv3.0.weight", 1), blocks=2)
    assert v.kind == "perm" and v.dim == 8
    # the stream: stem, residual and head, a permutation (SiLU, BatchNorm)
    stream = _with(report, ("stem.0.weight", 0), ("conv3.0.weight", 0), ("head.weight", 1))
    assert stream.kind == "perm" and stream.size == 16
    assert not [f for f in report.frozen if "unfold" in str(f.op) or "pad" in str(f.op)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_halo_attention_certifies_at_round_off(report, seed):
    m, x = _build(seed)
    assert report.certify(m, (x,)) <= 1e-12

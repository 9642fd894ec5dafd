"""Issue 65, HunYuan's rope row: its query/key RMS norms with per-dimension gains come after the
rotation. Scores that weigh each rotated coordinate by its own gain (``q·k = Σ g_i q_i k_i``)
keep a rotation of a pair only where the pair's two gains agree, so no ``rope`` class exists
(only a discrete subgroup survives) and the coverage checker says so, as it does for a norm
before the rotation; an RMS norm without gains commutes with the rotations and leaves the rope
classes. Shown numerically (a rotation of one pair by a generic angle, commuting with every
position's rotation, changes the output exactly when the gains of that pair differ), by the
analysis (no rope class, certified) and by the checker."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import symgraph
from benchmarks.coverage.attention import attention_units
from symgraph.passes.trace import trace
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def _rotate(x):
    s, n = x.shape[-2], x.shape[-1]
    f = torch.arange(s)[:, None] / 100.0 ** (torch.arange(0, n, 2) / n)[None]
    cos, sin = torch.cat([f.cos()] * 2, -1), torch.cat([f.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., n // 2:], x[..., : n // 2]], -1) * sin


class NormAfterRotation(nn.Module):
    """4 heads of 8, RoPE, then an RMS norm on queries and keys, with gains (``gains``) or not."""

    def __init__(self, gains: bool):
        super().__init__()
        self.gains = gains
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        if gains:  # (a parameter the program never reads would fix every class)
            self.gq, self.gk = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.rand(8) + 0.5)

    def _norm(self, x, g):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return g * x if self.gains else x

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self._norm(_rotate(q), getattr(self, "gq", None)), self._norm(_rotate(k), getattr(self, "gk", None))
        a = torch.softmax(q @ k.transpose(2, 3) / 8 ** 0.5, -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, 32))


def _turn_pair(m, i, angle):
    """A copy of ``m`` whose queries and keys have pair ``(i, i + 4)`` of every head turned by
    ``angle`` (the rotation RoPE applies to that pair, at a fixed angle: it commutes with it)."""
    m = __import__("copy").deepcopy(m)
    c, s = math.cos(angle), math.sin(angle)
    with torch.no_grad():
        for lin in (m.q, m.k):
            w = lin.weight.view(4, 8, 32)
            b = lin.bias.view(4, 8)
            for t in (w, b):
                a, bb = t[:, i].clone(), t[:, i + 4].clone()
                t[:, i], t[:, i + 4] = c * a - s * bb, s * a + c * bb
    return m


def _moved(m, other, x) -> float:
    with torch.no_grad():
        return float((m(x) - other(x)).abs().max())


def test_gains_after_the_rotation_admit_no_turn_of_a_pair():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    plain = NormAfterRotation(gains=False).double().eval()
    assert _moved(plain, _turn_pair(plain, 1, 0.7), x) < 1e-12  # RMS alone commutes
    gained = NormAfterRotation(gains=True).double().eval()
    assert _moved(gained, _turn_pair(gained, 1, 0.7), x) > 1e-3
    with torch.no_grad():  # equal gains on the pair (in queries and keys): the turn is kept
        gained.gq[5], gained.gk[5] = gained.gq[1], gained.gk[1]
    assert _moved(gained, _turn_pair(gained, 1, 0.7), x) < 1e-12
    assert _moved(gained, _turn_pair(gained, 2, 0.7), x) > 1e-3  # the next pair's still differ


@pytest.mark.parametrize("gains", [False, True])
def test_the_checker_and_the_analysis_agree(gains):
    torch.manual_seed(0)
    m, x = NormAfterRotation(gains).eval(), torch.randn(2, 6, 32)
    (unit,) = attention_units(trace(m, (x,))[0])
    assert unit["rotated"] and unit["qk_norm"] == gains
    rep = symgraph.analyze(m, (x,))
    ropes = [g for g in rep.groups if g.kind == "rope"]
    assert bool(ropes) != gains  # rope classes exactly where the checker expects them
    assert rep.certify(m, (x,)) <= 1e-6


def test_hunyuan_rotated_heads_are_blocked_and_certified():
    T = transformers
    cfg = T.HunYuanDenseV1Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=32, pad_token_id=63)
    m = randomized(T.HunYuanDenseV1ForCausalLM(cfg))
    rep = symgraph.analyze(m)
    units = attention_units(trace(m)[0])
    assert units and all(u["rotated"] and u["qk_norm"] for u in units)
    assert not [g for g in rep.groups if g.kind == "rope"]
    heads = [g for g in rep.group_of("model.layers.0.self_attn.q_proj.weight", 0) if g.kind == "perm"]
    assert heads  # the heads are still permuted
    assert rep.certify(m) <= 1e-6

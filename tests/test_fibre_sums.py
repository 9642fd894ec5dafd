"""A matrix product that sums over a fibre's base ends the fibre.

``y = P @ h`` with ``h [batch, heads, head_dim]`` and a stored ``P [heads, heads]`` sums each
output head over every input head: a map per head on the head dims (``h_m A_m``) comes out as
``Σ_m P[n, m] h_m A_m``, which no map of head ``n`` undoes. Every tensor there still holds the
heads on another axis, so only the product's rule can say it: the head dims keep one map for
all heads (they were fibred over the heads, and the certificate failed at 0.64)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import symgraph


class HeadMix(nn.Module):
    def __init__(self, mix: bool = True):
        super().__init__()
        self.mix = mix
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)
        self.P = nn.Parameter(torch.randn(4, 4) if mix else torch.randn(4))

    def forward(self, x):
        h = F.gelu(self.a(x)).view(x.shape[0], 4, 3)
        y = (torch.matmul(self.P, h) if self.mix else self.P[:, None] * h) + h
        return self.b(y.reshape(x.shape[0], 12))


def _report(mix):
    torch.manual_seed(0)
    m = HeadMix(mix).double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    return m, x, symgraph.analyze(m, (x,))


def test_heads_summed_by_a_matrix_keep_one_map_for_their_dims():
    m, x, r = _report(mix=True)
    (heads,) = r.group_of("P", 0)
    assert (heads.kind, heads.dim, heads.blocks) == ("perm", 4, 1) and r.group_of("P", 1) == [heads]
    dims = [g for g in r.group_of("a.weight", 0) if g.id != heads.id]
    assert [(g.kind, g.dim, g.blocks, g.outer) for g in dims] == [("perm", 3, 1, [])]
    assert r.certify(m, (x,), tol=1e-9) < 1e-9


def test_heads_scaled_one_by_one_keep_a_map_per_head():
    """The control: each head scaled by its own entry of ``P [heads]`` (no sum over heads) keeps
    the fibre."""
    m, x, r = _report(mix=False)
    (heads,) = r.group_of("P", 0)
    dims = [g for g in r.group_of("a.weight", 0) if g.id != heads.id]
    assert [(g.kind, g.dim, g.blocks, g.outer) for g in dims] == [("perm", 3, 4, [heads.id])]
    assert r.certify(m, (x,), tol=1e-9) < 1e-9


def test_heads_beside_an_axis_holding_every_heads_dims_stay_as_they_were():
    """Doge's ``dt_proj.weight [heads, kv_heads · head_dim]``: each row reads every head's value
    dims, so the heads on its first axis are no base of the head dims on its second (XLNet's
    ``q [d_model, heads, head_dim]`` holds the head dims alone there). Viewing it as one axis of
    (head, head dim) made the certificate fail at 4.4e-3; the block structure of the second axis
    already carries each key/value head's map."""
    from analyze_helpers import coverage_row
    for cls in ("DogeForCausalLM", "DogeForSequenceClassification"):
        model = coverage_row("doge", cls).double()
        report = symgraph.analyze(model)
        assert len(report.groups) == 7 and not report.frozen
        assert report.certify(model) < 1e-12

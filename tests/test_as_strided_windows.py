"""Issue 65, LED: Longformer's sliding-window attention cuts the sequence into overlapping
chunks with ``as_strided``. The rule passes the outermost axis (batch x heads) and the innermost
(head dim) through where the windows keep them whole, and fixes the sequence axes it reads as
windows; a window that mixes head-dim coordinates keeps them fixed."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph
from symgraph.passes.rules.views import _strided_axes


class Chunked(nn.Module):
    """Per-head queries and values cut into half-overlapping windows of the sequence (as LED's
    ``_chunk``), scored per window and projected back."""

    def __init__(self, d=16, heads=2, w=2):
        super().__init__()
        self.h, self.w = heads, w
        self.q, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def _chunk(self, x):  # [BH, S, D] -> [BH, 2 S/2w - 1, 2w, D]
        bh, s, d = x.shape
        x = x.view(bh, s // (2 * self.w), 2 * self.w, d)
        size, stride = list(x.size()), list(x.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return x.as_strided(size=size, stride=stride)

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.h, d // self.h).transpose(1, 2).reshape(b * self.h, s, d // self.h)  # noqa: E731
        q, v = self._chunk(split(self.q(x))), self._chunk(split(self.v(x)))
        att = torch.softmax(torch.einsum("bcxd,bcyd->bcxy", q, q), -1)
        out = torch.einsum("bcxy,bcyd->bcxd", att, v).sum(1)  # [BH, 2w, D/h]
        out = out.view(b, self.h, 2 * self.w, d // self.h).transpose(1, 2).reshape(b, 2 * self.w, d)
        return self.o(out)


def test_windows_keep_whole_rows_and_columns_only():
    val = torch.empty(6, 4, 4, 8)  # LED's chunk: rows (batch x heads) and head dims kept
    assert _strided_axes(val, [6, 7, 4, 8], [128, 16, 8, 1], 0) == {0: 0, 3: 3}
    assert _strided_axes(val, [6, 6, 4, 8], [128, 16, 8, 1], 4) == {0: 0}  # offset inside a row
    assert _strided_axes(val, [6, 8, 4, 8], [128, 16, 8, 1], 0) == {3: 3}  # reaches the next row
    assert _strided_axes(val.transpose(0, 1), [4, 6, 4, 8], [128, 16, 8, 1], 0) == {}  # not contiguous


def test_heads_pass_through_strided_windows():
    torch.manual_seed(0)
    A, x = Chunked().eval(), torch.randn(3, 8, 16)
    rep = symgraph.analyze(A, (x,))
    assert not any(f.op.startswith("aten.as_strided") for f in rep.frozen)
    vo = [g for g in rep.groups if ("v.weight", 0) in g.params]
    assert vo and ("o.weight", 1) in vo[0].params and vo[0].kind != "identity"
    assert rep.certify(A, (x,)) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=2, orthogonal=True))
    assert float((A.v.weight - B.v.weight).abs().max()) > 0.1
    C = symgraph.align(A, B, (x,)).apply(B)
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-5, n

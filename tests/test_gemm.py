"""``core.gemm.linear``: ``x @ wᵀ`` through oneDNN for row-major float32 CPU matrices, PyTorch's
matmul for everything else; the same values to float32 rounding, gradients where asked for."""
import pytest
import torch

import symgraph.core.gemm as G


def _pair(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 7), (300, 50, 64), (257, 129, 1030)])
def test_row_major_float32_goes_through_onednn_with_matmuls_values(m, n, k, monkeypatch):
    x, w = _pair(m, n, k)
    calls = []
    if G._OP is not None:
        op = G._OP
        monkeypatch.setattr(G, "_OP", lambda *a: calls.append(1) or op(*a))
    want = (x.double() @ w.double().mT)
    got = G.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert len(calls) == (1 if G._OP is not None else 0)
    # a slice of columns (rows with a stride) is still row-major
    torch.testing.assert_close(G.linear(x[:, : k // 2 + 1], w[:, : k // 2 + 1]),
                               x[:, : k // 2 + 1] @ w[:, : k // 2 + 1].mT, rtol=1e-5, atol=1e-4)


def test_everything_else_is_pytorchs_matmul(monkeypatch):
    """Transposed views, float64, bf16, empty matrices and tensors to differentiate are
    PyTorch's matmul, exactly."""
    monkeypatch.setattr(G, "_OP", lambda *a: pytest.fail("oneDNN called"))
    x, w = _pair(40, 30, 20)
    for a, b in ((x.mT.contiguous().mT, w), (x, w.mT.contiguous().mT), (x.double(), w.double()),
                 (x.bfloat16(), w.bfloat16()), (x[:0], w), (x, w[:0])):
        assert torch.equal(G.linear(a, b), a @ b.mT)
    xg = x.clone().requires_grad_()
    out = G.linear(xg, w)
    out.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand_as(x))


def test_a_build_whose_onednn_refuses_falls_back_to_matmul(monkeypatch):
    def refuse(*a):
        raise RuntimeError("could not create a primitive")
    monkeypatch.setattr(G, "_OP", refuse)
    x, w = _pair(40, 30, 20)
    assert torch.equal(G.linear(x, w), x @ w.mT) and G._OP is None

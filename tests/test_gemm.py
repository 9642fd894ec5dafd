"""``core.gemm.linear``: ``x @ wᵀ`` through oneDNN for row-major float32 CPU matrices, PyTorch's
matmul for everything else; the same values to float32 rounding, gradients where asked for.
Half-precision products on a CPU without fast kernels for them: in float32, rounded once."""
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
    """Transposed views, float64, bf16 (where it has a fast kernel), empty matrices and tensors
    to differentiate are PyTorch's matmul, exactly."""
    monkeypatch.setattr(G, "_OP", lambda *a: pytest.fail("oneDNN called"))
    monkeypatch.setattr(G, "slow_on_cpu", lambda dtype: False)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_without_a_fast_kernel_run_in_float32_rounded_once(dtype, monkeypatch):
    """Where the CPU has no fast kernel for a half dtype (PyTorch's reference one runs about
    1 GFLOP/s), linear, matmul and einsum compute in float32 and round the result once to the
    operands' dtype: within one rounding of the exact product, like the native kernel."""
    monkeypatch.setattr(G, "slow_on_cpu", lambda dt: dt in (torch.bfloat16, torch.float16))
    x, w = (t.to(dtype) for t in _pair(33, 21, 300, seed=1))
    exact = x.double() @ w.double().mT
    ulp = exact.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    for got in (G.linear(x, w), G.matmul(x, w.mT), G.einsum("ik,jk->ij", x, w)):
        assert got.dtype == dtype
        assert bool(((got.double() - exact).abs() <= ulp + 1e-6).all())  # one rounding of a float32 sum
    b = torch.randn(4, 21, 33).to(dtype)
    torch.testing.assert_close(G.matmul(b, x).double(), b.double() @ x.double(), rtol=2 ** -7, atol=1e-2)
    xg = x.float().requires_grad_()  # float32 and tensors to differentiate: untouched
    assert torch.equal(G.matmul(xg, w.float().mT), xg @ w.float().mT)


def test_the_probe_names_a_fast_kernel_only_for_half_dtypes():
    assert G.slow_on_cpu(torch.float32) is False and G.slow_on_cpu(torch.float64) is False
    assert isinstance(G.slow_on_cpu(torch.bfloat16), bool)


def test_a_graph_run_computes_half_products_in_float32_where_they_are_slow(monkeypatch):
    """The op-by-op graph runs (barrier, statistics, REPAIR) send a bf16 model's products
    through :func:`graph_op`: in float32, rounded once, the model's function to bf16 rounding."""
    from symgraph.alignment.graphrun import streamed_outputs
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ep = torch.export.export(m, (x,))
    state = dict(m.state_dict())
    fetch = lambda n: state[n.removeprefix("_orig_mod.")]  # noqa: E731
    seen = []
    forced = lambda dt: dt in (torch.bfloat16, torch.float16)  # noqa: E731
    monkeypatch.setattr(G, "slow_on_cpu", lambda dt: seen.append(dt) or forced(dt))
    got, = streamed_outputs(ep, (x,), {}, fetch)
    assert got.dtype == torch.bfloat16 and torch.bfloat16 in seen
    exact = m.double()(x.double())
    assert (got.double() - exact).abs().max() <= 0.05 * exact.abs().max()  # bf16 roundings only
    assert G.graph_op(torch.ops.aten.mm.default, (x.float(), x.float().T)) is torch.ops.aten.mm.default
    assert G.graph_op(torch.ops.aten.gelu.default, (x,)) is torch.ops.aten.gelu.default
    assert G.graph_op(torch.ops.aten.mm.default, (x, x.T)) is not torch.ops.aten.mm.default

"""Host decompositions run on one thread: the result does not depend on the caller's number
of intra-op threads, and that number is restored (also when the decomposition raises)."""
import pytest
import torch

from symgraph.solve import procrustes
from symgraph.solve._polar import decompose, one_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_decompose_runs_on_one_thread_and_restores(two_threads):
    seen = []

    def fn(x, **kw):
        seen.append(torch.get_num_threads())
        return torch.linalg.svd(x, **kw)

    decompose(fn, torch.randn(8, 8), full_matrices=False)
    assert seen == [1]
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_procrustes_same_whatever_the_callers_threads(two_threads):
    g = torch.Generator().manual_seed(0)
    S = torch.randn(384, 512, generator=g) @ torch.randn(512, 384, generator=g)
    batch = torch.randn(32, 64, 64, generator=g, dtype=torch.float64)
    got = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        got[threads] = procrustes(S).element, procrustes(batch).element
    for a, b in zip(got[1], got[2]):
        assert torch.equal(a, b)
    R = got[2][0]
    assert torch.allclose(R @ R.mT, torch.eye(384), atol=1e-4)
    U, _, Vh = torch.linalg.svd(S.double())
    assert torch.allclose(R.double(), U @ Vh, atol=1e-4)

"""The certificate's memory grows with the model, not with the square of a class's width: a
fused projection's segments (SwiGLU's gate and up halves of one ``linear``, Cohere2-Vision's
36864-row projector) are moved by one index vector (:func:`symgraph.passes.blockmaps.sum_index`),
never by the ``n×n`` float64 matrix (10 GB at 36864 rows)."""
import multiprocessing
import resource

import torch

import symgraph
from symgraph.passes.blockmaps import block_map


class FusedGLU(torch.nn.Module):
    """``down(silu(a) * b)`` with ``a, b`` the two halves of one projection."""

    def __init__(self, width=16, inner=64):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * inner)
        self.down = torch.nn.Linear(inner, width)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(a) * b)


def _model(inner, seed=0):
    torch.manual_seed(seed)
    return FusedGLU(inner=inner).eval()


def test_fused_segments_move_by_one_index_vector():
    model = _model(24)
    x = torch.randn(3, 16)
    rep = symgraph.analyze(model, x)
    (up,) = [a for n, _ in model.named_parameters() if n == "up.weight" for a in rep.param_axes(n)[:1]]
    assert rep.axis_structure(up)[0] == "sum"
    for seed in range(3):
        elements = rep.random_transform(seed=seed).elements
        fast = block_map(rep._analysis, up, rep._roots(elements))
        dense = rep._composed_map(up, rep._roots(elements), False)  # the n×n route
        assert fast.dim() == 1 and fast.dtype == torch.long and len(fast) == 48
        assert torch.equal(fast, dense.argmax(1)) and torch.equal(dense.sum(1), torch.ones(48, dtype=dense.dtype))
        assert not torch.equal(fast, torch.arange(48))  # a permutation that moves something
        assert torch.equal(fast[24:] - 24, fast[:24])  # both halves by the same permutation
    assert rep.certify(model, x) <= 1e-12


def _peak_of_certify(inner, conn):
    model = _model(inner)
    x = torch.randn(2, 16)
    rep = symgraph.analyze(model, x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worst = rep.certify(model, x)
    conn.send((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, worst))
    conn.close()


def _measure(inner):
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_peak_of_certify, args=(inner, b))
    p.start()
    got = a.recv()
    p.join()
    return got


def test_certificate_peak_memory_is_linear_in_the_fused_width():
    """At 4096 rows a half the dense route held 2 × 128 MB of parts and a 512 MB matrix; the
    index vectors hold 64 KB. The peak of the certificate (resident set size, KB) grows by
    less than 64 MB from 512 to 4096 rows."""
    small, w_small = _measure(256)
    large, w_large = _measure(4096)
    assert w_small <= 1e-12 and w_large <= 1e-12
    assert large - small < 64 * 1024, (small, large)


class Stack(torch.nn.Module):
    """Eight residual relu MLPs behind RMS norms (folded gains) on a stream read in and out by
    linear maps (every square weight moves on both sides)."""

    def __init__(self, width=512, depth=8):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(16, width), torch.nn.Linear(width, 4)
        self.ups = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(width) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        for up, down, norm in zip(self.ups, self.downs, self.norms):
            x = x + down(torch.relu(up(norm(x))))
        return self.out(x)


def _rss(field):
    """``field`` of this process's status (KB): VmRSS now, VmHWM its peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_of_transform(conn):
    torch.manual_seed(0)
    model = Stack().double().eval()
    x = torch.randn(2, 16, dtype=torch.float64)
    t = symgraph.analyze(model, x).random_transform(seed=1)
    with open("/proc/self/clear_refs", "w") as f:  # the peak so far is the analysis's: reset it
        f.write("5")
    before = _rss("VmRSS")
    moved = symgraph.transform(model, t)
    grew = _rss("VmHWM") - before
    size = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    with torch.no_grad():
        conn.send((grew, size, float((moved(x) - model(x)).norm() / model(x).norm())))
    conn.close()


def test_a_transform_holds_one_copy_of_the_model():
    """The moved copy is written piece by piece: the peak grows by the copy and a piece's
    temporaries (measured 1.6x the model), not by every new value held before any is written
    (4.4x before; 32 MB of float64 layers)."""
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_peak_of_transform, args=(b,))
    p.start()
    grew, size, err = a.recv()
    p.join()
    assert err < 1e-12
    assert size < grew < 2.5 * size, (grew, size)

"""REPAIR on BatchNorm nets (``merge(..., repair=True, data=...)``): the merged model's running
statistics reset to its own population statistics, the effect on trained merges, modes and
mixed nets."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.testing import models

from repair_helpers import moments as _moments
from repair_helpers import one_thread  # noqa: F401 - an autouse fixture

F = torch.nn.functional


# --- BatchNorm nets: REPAIR resets the merged model's running statistics ---------------------


class DigitsCNN(torch.nn.Module):
    """conv-BN-ReLU, conv-BN-ReLU-maxpool, conv-BN-ReLU-maxpool, linear: 1×8×8 digits."""

    def __init__(self, w=(8, 16, 16)):
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv2d(1, w[0], 3, padding=1), nn.BatchNorm2d(w[0])
        self.c2, self.b2 = nn.Conv2d(w[0], w[1], 3, padding=1), nn.BatchNorm2d(w[1])
        self.c3, self.b3 = nn.Conv2d(w[1], w[2], 3, padding=1), nn.BatchNorm2d(w[2])
        self.fc = nn.Linear(4 * w[2], 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        return self.fc(F.max_pool2d(F.relu(self.b3(self.c3(x))), 2).flatten(1))


@pytest.fixture(scope="module")
def cnn_pair():
    """Two digits CNNs trained 200 steps from different seeds (init and data order); the
    training split in batches of 256 (the last one shorter), the held-out split."""
    from benchmarks.data import digits
    torch.set_num_threads(1)
    X, y = digits("train")
    trained = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m, gen = DigitsCNN(), torch.Generator().manual_seed(100 + seed)

        def sample():
            i = torch.randint(0, len(y), (64,), generator=gen)
            return X[i], y[i]
        models.train(m, sample, steps=200, lr=3e-3, threads=1,
                     loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        trained.append(m)
    data = [(X[i:i + 256],) for i in range(0, len(X), 256)]
    return trained[0], trained[1], data, digits("eval")


def _bn_inputs(model, data):
    """``{BatchNorm module name: [channels, values]}``: its inputs on ``data``, eval mode."""
    out, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: out.setdefault(
                name, []).append(a[0].detach().double().transpose(0, 1).flatten(1))))
    try:
        with torch.no_grad():
            for batch in data:
                model.eval()(*batch)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v, 1) for k, v in out.items()}


def _assert_population_statistics(model, data, names):
    acts = _bn_inputs(model, data)
    for n in names:
        bn = model.get_submodule(n)
        assert torch.allclose(bn.running_mean.double(), acts[n].mean(1), atol=1e-5, rtol=0), n
        assert torch.allclose(bn.running_var.double(), acts[n].var(1), atol=1e-5, rtol=1e-5), n


@pytest.mark.parametrize("align", [None, "weights"])
def test_batchnorm_statistics_are_reset_to_the_merges_own(cnn_pair, align):
    """conv → BN → ReLU leaves no channel to renormalise: REPAIR recomputes every BatchNorm's
    running mean and (unbiased) variance on the data, for the merged model itself (each layer
    after the ones before it); nothing else of the merge changes, the parents stay as they
    were, and the report shows the variance collapse it undid."""
    A, B, data, _ = cnn_pair
    before = [copy.deepcopy(m.state_dict()) for m in (A, B)]
    plain = symgraph.merge([A, B], data=data, align=align)
    res = symgraph.merge([A, B], data=data, align=align, repair=True)
    for m, sd in zip((A, B), before):
        assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())
        assert not m.training
    rep = res.repair
    assert rep.layers == [] and [x.name for x in rep.batchnorm] == ["b1", "b2", "b3"]
    assert [x.channels for x in rep.batchnorm] == [8, 16, 16]
    n = sum(len(b[0]) for b in data)
    assert [x.samples for x in rep.batchnorm] == [n * 64, n * 64, n * 16]  # 8×8, 8×8, 4×4
    assert all(x.std_ratio < 0.95 for x in rep.batchnorm), rep.batchnorm  # variance collapse
    # the merge engine resets every BatchNorm in one pass over the data (no parent is measured)
    assert rep.passes == 1 and res.timings["repair"] == rep.seconds > 0
    assert rep.to_dict()["batchnorm"][0]["name"] == "b1"
    assert "BatchNorm statistics reset in 3 layers" in rep.summary()
    assert not any(m.training for m in res.model.modules())
    _assert_population_statistics(res.model, data, ["b1", "b2", "b3"])
    stats = {f"b{i}.running_{s}" for i in (1, 2, 3) for s in ("mean", "var")}
    sp, sr = plain.model.state_dict(), res.model.state_dict()
    assert sp.keys() == sr.keys()
    for k in sp:
        assert torch.equal(sp[k], sr[k]) != (k in stats), k  # only the running statistics moved
    assert all(m.momentum == 0.1 for m in res.model.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_batchnorm_reset_lowers_the_loss_of_trained_merges(cnn_pair):
    """Midpoint merges of the trained pair on the held-out digits: with the BatchNorm
    statistics reset the loss is lower, unaligned or aligned by weights or activations."""
    A, B, data, (X, y) = cnn_pair

    def loss(m):
        with torch.no_grad():
            return float(F.cross_entropy(m(X), y))
    ends = max(loss(A), loss(B))
    # measured (1 thread, torch 2.13): endpoints 0.072 / 0.037; unaligned 1.878 -> repaired
    # 1.497; aligned by weights 0.941 -> 0.605; by activations 1.129 -> 0.390
    for align in (None, "weights", "activations"):
        merged = loss(symgraph.merge([A, B], data=data, align=align).model)
        repaired = loss(symgraph.merge([A, B], data=data, align=align, repair=True).model)
        assert merged > ends + 0.1, (align, ends, merged)
        assert repaired < merged - 0.1, (align, ends, merged, repaired)


def test_reset_batchnorm_keeps_modes_and_handles_mixed_nets():
    """A net with a renormalised channel (conv → ReLU) before a conv → BN → ReLU: REPAIR
    corrects the channel and then resets the BatchNorm, whose input the correction moved;
    both end exact. Train mode, momentum and the batch counter are kept; dict batches work, and
    a BatchNorm the forward never calls keeps its merged statistics."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 6, 3)
            self.bn = torch.nn.BatchNorm2d(6, momentum=None)
            self.fc = torch.nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(F.relu(self.bn(self.c2(F.relu(self.c1(x))))).mean((2, 3)))

    torch.manual_seed(0)
    A, B = Net().train(), Net().train()
    with torch.no_grad():
        for m in (A, B):
            m.bn.running_var.uniform_(0.5, 2)
            m.bn.num_batches_tracked.fill_(5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 3, 9, 9, generator=g),) for _ in range(3)]
    res = symgraph.merge([A, B], data=data, align=None, repair=True)
    rep = res.repair
    assert [x.weight for x in rep.layers] == ["c1.weight"] and rep.layers[0].after < 1e-5
    # the parents' targets, then one pass over the merge: c1 renormalised before bn is reset
    assert [x.name for x in rep.batchnorm] == ["bn"] and rep.passes == 2 + 1
    M = res.model
    assert M.training and M.bn.training and M.bn.momentum is None
    assert int(M.bn.num_batches_tracked) == 5
    _assert_population_statistics(M, data, ["bn"])

    def c1(m):  # [values, channels] of c1's output
        with torch.no_grad():
            return torch.cat([m.eval().c1(b[0]).double().transpose(0, 1).flatten(1).T for b in data])
    target = 0.5 * (_moments(c1(A))[1] + _moments(c1(B))[1])
    assert torch.allclose(_moments(c1(M))[1], target, rtol=1e-4, atol=0)
    # dict batches; a BatchNorm the forward never calls keeps the merge's (the average) statistics
    class Kw(Net):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.BatchNorm2d(3)

        def forward(self, pixels):
            return super().forward(pixels)
    K1, K2 = Kw(), Kw()
    with torch.no_grad():
        K2.unused.running_mean.fill_(1.0)
    kw = [{"pixels": b[0]} for b in data]
    res, plain = (symgraph.merge([K1, K2], data=kw, align=None, repair=r) for r in (True, False))
    out = res.repair.batchnorm
    assert [x.name for x in out] == ["bn"] and out[0].samples == 15 * 25
    assert float(res.model.unused.running_mean[0]) == 0.5
    assert all(torch.equal(v, res.model.unused.state_dict()[k]) for k, v in plain.model.unused.state_dict().items())
    _assert_population_statistics(res.model, data, ["bn"])

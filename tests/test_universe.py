"""N models in one universe (issue 15, item 4): ``merge(models, anchor="universe")`` aligns
every model to the mean of the others until no element changes (MergeMany)."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.testing import models
from symgraph.core.elements import Map
from symgraph.errors import InputError

# --- a toy regression task and briefly trained MLPs -------------------------------------------
D, WIDTHS = 4, (4, 64, 64, 1)
_W = torch.randn(D, 3, generator=torch.Generator().manual_seed(99))


def _task(seed, n=512):
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ _W).sum(1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]


X, Y = _task(123)
XT, YT = _task(7)  # held out
INPUTS = (X[:4],)


def _train(seed, widths=WIDTHS, steps=300):
    m = models.mlp(seed, widths).train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1000)
    for _ in range(steps):
        idx = torch.randint(0, len(X), (64,), generator=g)
        loss = ((m(X[idx]) - Y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def _loss(m):
    with torch.no_grad():
        return float(((m(XT) - YT) ** 2).mean())


@pytest.fixture(scope="module")
def trained():
    return [_train(s) for s in range(5)]


def _snapshot(ms):
    return [copy.deepcopy(m.state_dict()) for m in ms]


def _untouched(ms, before):
    return all(torch.equal(v, m.state_dict()[k]) and m.state_dict()[k].dtype == v.dtype
               for m, b in zip(ms, before) for k, v in b.items())


def _rel_distance(a, b):
    num = sum(float(((p - q) ** 2).sum()) for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum(float((p ** 2).sum()) for p in a.parameters())) ** 0.5


# --- (1) exactly transformed copies ---------------------------------------------------------
def _copies(name):
    if name == "mlp":
        A = models.randomize_vectors(models.mlp(0, (6, 16, 12, 3)), 0).double()
        x = (torch.randn(5, 6, dtype=torch.float64),)
        out = lambda m: m(*x)  # noqa: E731
    else:  # llama: GQA, RoPE rotations, per-head GL, residual rotations (folded RMSNorm)
        A = models.randomize_vectors(models.build("llama", 0), 0).double()
        x = None
        ids = torch.randint(0, A.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        out = lambda m: m(ids, use_cache=False).logits  # noqa: E731
    rep = symgraph.analyze(A, x)
    return A, x, rep, out


@pytest.mark.parametrize("name,n", [("mlp", 4), ("mlp", 8), ("llama", 4)])
@pytest.mark.slow
def test_transformed_copies_merge_back_to_the_model(name, n):
    A, x, rep, out = _copies(name)
    copies = [A] + [symgraph.transform(A, rep.random_transform(seed=s, orthogonal=True))
                    for s in range(1, n)]
    with torch.no_grad():
        ref = out(A)
        assert all((out(c) - ref).abs().max() < 1e-6 * ref.abs().max() for c in copies)  # same function
    assert all(_rel_distance(A, c) > 0.1 for c in copies[1:])  # really scrambled
    before = _snapshot(copies)
    res = symgraph.merge(copies, x, anchor="universe")
    u = res.universe
    assert u["converged"] and u["stopped"] == "converged" and 1 <= u["rounds"] <= 2
    assert u["changed"][-1] == 0 and len(u["changed"]) == u["rounds"]
    assert u["distance"][-1] < 1e-20  # every copy lands on the same weights
    assert all(al is not None for al in res.alignments) and len(res.alignments) == n
    with torch.no_grad():
        got = out(res.model)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6
    assert next(res.model.parameters()).dtype == torch.float64
    assert _untouched(copies, before)


# --- (2) trained models: matched to each other, no worse than the anchor ---------------------
@pytest.mark.parametrize("n", [3, 5])
def test_universe_merge_of_trained_models(trained, n):
    ms = trained[:n]
    before = _snapshot(ms)
    parents = sum(map(_loss, ms)) / n
    vanilla = _loss(symgraph.merge(ms, INPUTS, align=None).model)
    anchor = _loss(symgraph.merge(ms, INPUTS).model)
    res = symgraph.merge(ms, INPUTS, anchor="universe", universe_options={"max_rounds": 20})
    u, universe = res.universe, _loss(res.model)
    assert parents < anchor < vanilla  # the task: alignment matters
    assert universe <= anchor + 0.02, (universe, anchor)
    assert u["rounds"] >= 1 and len(u["changed"]) == len(u["changed_per_model"]) == u["rounds"]
    assert all(len(c) == n for c in u["changed_per_model"])
    # round 1 matched the models to each other (not only to model 0): elements moved
    assert u["changed"][0] > 0 and sum(u["changed_per_model"][0][1:]) > 0
    assert u["distance"][-1] < u["distance"][0]  # the spread MergeMany shrinks
    assert u["elements"] == [2] * n and all(al is not None for al in res.alignments)
    assert res.timings["align"] >= u["seconds"] > 0
    assert _untouched(ms, before)


def test_converged_universe_is_a_fixed_point(trained):
    ms = trained[:3]
    res = symgraph.merge(ms, INPUTS, anchor="universe", universe_options={"max_rounds": 20})
    assert res.universe["converged"] and res.universe["changed"][-1] == 0
    states = [al.state(m) for al, m in zip(res.alignments, ms)]
    for i, m in enumerate(ms):  # model i realigned to the mean of the others: nothing moves
        target = copy.deepcopy(ms[0])
        with torch.no_grad():
            for k, p in target.named_parameters():
                p.copy_(sum(s[k] for j, s in enumerate(states) if j != i) / 2)
        again = symgraph.align(target, m, INPUTS)
        for gid, el in res.alignments[i].elements.items():
            assert torch.equal(el.index, again.elements[gid].index), (i, gid)
    avg = {k: sum(s[k] for s in states) / 3 for k in states[0]}  # and the merge is their mean
    for k, p in res.model.named_parameters():
        assert torch.allclose(p, avg[k], atol=1e-6)


def test_methods_with_data_and_other_widths(trained):
    ms = trained[:3]
    data = [(X[i:i + 64],) for i in range(0, 256, 64)]
    before = _snapshot(ms)
    anchor = _loss(symgraph.merge(ms, data=data, method="regmean").model)
    res = symgraph.merge(ms, data=data, method="regmean", repair=True, anchor="universe")
    assert _loss(res.model) <= anchor + 0.02 and res.repair is not None
    wide = _train(5, (4, 96, 64, 1))  # a wider model joins: maps, result in models[0]'s widths
    res = symgraph.merge(ms + [wide], INPUTS, anchor="universe")
    assert [p.shape for p in res.model.parameters()] == [p.shape for p in ms[0].parameters()]
    assert any(isinstance(e, Map) for e in res.alignments[3].elements.values())
    assert _loss(res.model) <= _loss(symgraph.merge(ms + [wide], INPUTS).model) + 0.02
    assert _untouched(ms, before)


def test_a_common_drift_is_not_a_change():
    """The universe is defined up to one element applied to every model: a round that moves
    every model's element of a class by the same D (E_i' = D E_i) changes nothing else."""
    from symgraph.core.elements import Perm
    from symgraph.merging.universe import round_changes as _changes
    g = torch.Generator().manual_seed(0)
    rot = lambda: torch.linalg.qr(torch.randn(2, 6, 6, generator=g, dtype=torch.float64))[0]  # noqa: E731
    E = [rot() for _ in range(3)]
    P = [Perm(torch.randperm(5, generator=g)) for _ in range(3)]
    D, d = rot(), torch.randperm(5, generator=g)
    before = [{0: e, 1: p} for e, p in zip(E, P)]
    after = [{0: D @ e, 1: Perm(p.index[d])} for e, p in zip(E, P)]  # every model, same D / d
    assert _changes(before, after, 1e-9) == ([0, 0, 0], 2, pytest.approx(float(max(
        (D @ e - e).abs().max() for e in E))))
    after[2] = {0: rot(), 1: Perm(P[2].index.flip(0))}  # one model moved on its own
    assert _changes(before, after, 1e-9)[:2] == ([2, 2, 2], 0)  # every model counts as moved
    assert _changes(before, before, 0.0) == ([0, 0, 0], 0, 0.0)
    # models[0] before round 1 holds no element: the identity
    assert _changes([{}, {0: E[1]}], [{0: D}, {0: D @ E[1]}], 1e-9)[:2] == ([0, 0], 1)


# --- (3) soft maps ------------------------------------------------------------------------
def test_soft_maps_stop_at_max_rounds_or_converge(trained):
    ms = trained[:3]
    before = _snapshot(ms)
    kw = dict(solver="sinkhorn", reg=0.1, anchor="universe")
    res = symgraph.merge(ms, INPUTS, universe_options={"max_rounds": 3}, **kw)
    u = res.universe
    assert not u["converged"] and u["stopped"] == "max_rounds" and u["rounds"] == 3
    assert len(u["changed"]) == 3 and all(c > 0 for c in u["changed"])
    assert all(d > 1e-4 for d in u["max_change"])  # soft maps still moving, recorded
    assert all(isinstance(e, Map) and not torch.equal(e.co, e.co.round())  # soft, not a permutation
               for al in res.alignments for e in al.elements.values())
    assert torch.isfinite(res.model(XT)).all()
    # every soft map's entries lie in [0, 1]: with tol=1 the first round cannot change anything
    res = symgraph.merge(ms, INPUTS, universe_options={"max_rounds": 3, "tol": 1.0}, **kw)
    assert res.universe["converged"] and res.universe["rounds"] == 1
    assert _untouched(ms, before)


# --- (4) bad input ------------------------------------------------------------------------
def test_bad_input_is_refused(trained):
    ms = trained[:2]
    cases = [
        (dict(models=ms, anchor="foo"), r"anchor 'foo'; expected a model index .* or 'universe'"),
        (dict(models=ms, anchor=2), r"anchor 2 is not one of the 2 models; expected an index 0\.\.1"),
        (dict(models=ms, anchor=True), r"anchor True; expected a model index"),
        (dict(models=ms[:1], anchor="universe"), r"at least 2 models, got 1"),
        (dict(models=ms, anchor="universe", align=None), r"anchor universe .*; expected align weights or activations"),
        (dict(models=ms, anchor="universe", universe_options={"rounds": 3}),
         r"unknown universe option\(s\) \['rounds'\]"),
        (dict(models=ms, anchor="universe", universe_options={"max_rounds": 0}), r"max_rounds=0"),
        (dict(models=ms, anchor="universe", universe_options={"tol": -1.0}), r"tol=-1.0"),
        (dict(models=ms, universe_options={"max_rounds": 3}), r"only with anchor='universe'"),
    ]
    for kw, msg in cases:
        with pytest.raises(InputError, match=msg):
            symgraph.merge(kw.pop("models"), INPUTS, **kw)


def test_integer_anchors_unchanged(trained):
    ms = trained[:3]
    last = symgraph.merge(ms, INPUTS, anchor=-1)
    two = symgraph.merge(ms, INPUTS, anchor=2)
    assert last.universe is None and last.alignments[2] is None
    for p, q in zip(last.model.parameters(), two.model.parameters()):
        assert torch.equal(p, q)

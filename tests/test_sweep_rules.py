"""When weight matching's sweeps end: ``until="exact"`` (no element changes), ``until="discrete"``
(from the second sweep on, no permutation, head matching or other discrete element changes) or
``until="gap"`` (the default: no discrete change and no solve closing 5% of its unit's gap to the
Cauchy–Schwarz bound)."""
from __future__ import annotations

import pytest

import torch

import symgraph
from symgraph.core.elements import Perm
from symgraph.testing import models as M


def _pair(seed_b=1):
    return M.build("llama", seed=0), M.build("llama", seed=seed_b)


def test_sweeps_end_once_no_discrete_element_changes():
    """``until="discrete"``: on an unrelated pair whose rotations drift without end,
    the sweeps stop once one changes no permutation or head matching, sooner than the exact
    rule's run to its cap; the result is still B's function, and each permutation's order is
    one the exact rule also reaches at that sweep (the same computations up to there)."""
    A, B = _pair()
    x = torch.randint(0, A.config.vocab_size, (2, 8))
    disc = symgraph.align(A, B, until="discrete")
    exact = symgraph.align(A, B, until="exact")
    n = disc.seconds["sweeps"]
    assert 2 <= n < exact.seconds["sweeps"] == 6, (n, exact.seconds)
    with torch.no_grad():
        assert torch.allclose(disc.apply(B)(x, use_cache=False).logits, B(x, use_cache=False).logits, atol=1e-4)
    same_sweeps = symgraph.align(A, B, max_iter=n, until="exact")
    for g, e in disc.elements.items():
        other = same_sweeps.elements[g]
        assert type(e) is type(other)
        if isinstance(e, Perm):
            assert torch.equal(e.index, other.index), g


def test_a_model_of_permutations_alone_sweeps_as_the_exact_rule():
    """With only permutation classes every change is discrete: ``until="discrete"`` runs the
    same sweeps to the same elements as the exact rule."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12), torch.nn.ReLU(),
                                torch.nn.Linear(12, 3)).double() for _ in range(2)]
    x = torch.randn(4, 6, dtype=torch.float64)
    disc = symgraph.align(*nets, (x,), until="discrete")
    exact = symgraph.align(*nets, (x,), until="exact")
    assert disc.seconds["sweeps"] == exact.seconds["sweeps"] >= 2
    assert disc.elements.keys() == exact.elements.keys()
    for g, e in disc.elements.items():
        assert isinstance(e, Perm) and torch.equal(e.index, exact.elements[g].index)


def test_discrete_change_tells_orders_from_drift():
    from symgraph.alignment.sweeps import _discrete_change
    R = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))[0]
    P, Q = torch.eye(4)[[1, 0, 2, 3]], torch.eye(4)
    assert _discrete_change(None, R) and not _discrete_change(R, R + 1e-3)  # a rotation drifting
    assert _discrete_change(P, Q) and not _discrete_change(2 * P, -3 * P)  # order vs. scale, sign
    assert _discrete_change(torch.stack([P, Q]), torch.stack([P, P]))  # one head's order within a batch
    assert _discrete_change(P, R[:4, :4]) and _discrete_change(R, R[:4, :4])  # form or shape
    assert _discrete_change(Perm(torch.tensor([1, 0])), Perm(torch.tensor([0, 1])))
    assert not _discrete_change(Perm(torch.tensor([1, 0])), Perm(torch.tensor([1, 0])))


@pytest.mark.slow
def test_gap_stops_an_unrelated_pair_and_lets_a_copy_converge():
    """``until="gap"`` (the default): an unrelated pair, whose rotations drift by a small share
    of a gap near the whole bound, stops where the discrete rule does; a transformed copy whose
    nested head classes converge slowly (fused QKV with grouped K/V) sweeps on as the exact rule
    does, to the same elements, where the discrete rule leaves it 7e-2 away."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import FusedGQA

    A, B = _pair()
    gap, disc = symgraph.align(A, B), symgraph.align(A, B, until="discrete")
    assert gap.seconds["sweeps"] == disc.seconds["sweeps"] < 6

    torch.manual_seed(0)
    m, x = FusedGQA().eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    want = m.state_dict()

    def error(**kw):
        al = symgraph.align(m, moved, (x,), outputs=r.outputs, max_iter=12, **kw)
        got = al.apply(moved).state_dict()
        return al.seconds["sweeps"], max((got[k] - want[k]).abs().max().item() for k in want)

    (n_gap, e_gap), (n_exact, e_exact), (n_disc, e_disc) = error(), error(until="exact"), error(until="discrete")
    assert n_gap == n_exact == 12 and e_gap == e_exact < 1e-4, (n_gap, e_gap, e_exact)
    assert n_disc < 6 and e_disc > 1e-2, (n_disc, e_disc)


def test_the_bound_holds_and_is_reached_by_a_copy():
    """The Cauchy–Schwarz bound ``Σ ‖X_A‖ ‖X_B‖`` a class's similarity reports is at least what
    any orthogonal element scores (its nuclear norm, Procrustes' optimum), with equality for a
    model against itself; :func:`frobenius` is the float64 norm in any memory order."""
    from symgraph.alignment.weights import WeightFeatures, frobenius
    x = torch.randn(40, 3, 50).to(torch.bfloat16)
    for t in (x, x.transpose(0, 2), x.permute(1, 2, 0)[:, ::2]):
        assert abs(frobenius(t) - t.double().norm().item()) < 1e-9 * t.double().norm().item()
    A, B = _pair()
    ra, rb = symgraph.analyze(A), symgraph.analyze(B)
    checked = 0
    for other, rel in ((B, False), (A, True)):
        f = WeightFeatures.from_models(ra, rb if other is B else ra, A, other, bounds=True)
        for g in ra.groups:
            if g.outer or g.kind not in ("orthogonal", "perm"):
                continue
            S, _, _ = f.similarity(g, g, {}, False)
            if S is None or S.dim() != 2:
                continue
            nuclear, bound = torch.linalg.matrix_norm(S.double(), "nuc").item(), f.bounds[g.id]
            assert nuclear <= bound * (1 + 1e-9), (g.id, nuclear, bound)
            if rel:
                assert abs(nuclear - bound) <= 1e-6 * bound, (g.id, nuclear, bound)
            checked += 1
    assert checked >= 4

"""When weight matching's sweeps end: ``until="exact"`` (no element changes, the default) or
``until="discrete"`` (from the second sweep on, no permutation, head matching or other discrete
element changes)."""
from __future__ import annotations

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
    exact = symgraph.align(A, B)  # until="exact", the default
    n = disc.seconds["sweeps"]
    assert 2 <= n < exact.seconds["sweeps"] == 6, (n, exact.seconds)
    with torch.no_grad():
        assert torch.allclose(disc.apply(B)(x, use_cache=False).logits, B(x, use_cache=False).logits, atol=1e-4)
    same_sweeps = symgraph.align(A, B, max_iter=n)
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
    exact = symgraph.align(*nets, (x,))
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

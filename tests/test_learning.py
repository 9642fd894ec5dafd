"""Learned matching's one step loop (:mod:`symgraph.alignment.learning`), whatever computes the
loss: what it asks of an :class:`~symgraph.alignment.learning.Objective` (one ``begin``, a step
per batch ``step mod len(data)`` with λ from the seeded generator, one ``end``, also when a step
fails), what it leaves in the alignment (elements exactly on their groups, moved by the steps,
kept where ``stored`` puts them), and the start it chooses. The in-memory and out-of-core
objectives' equality is tests/test_engine_refine.py's."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.alignment import learning
from symgraph.alignment.learning import Objective, choose_start, draw_lambda, learned_matching, refine_elements
from symgraph.core.elements import Perm
from symgraph.testing.models import build

SIZES = dict(vocab=32, hidden=16, layers=1, heads=2, kv_heads=1, mlp=24, positions=16)


@pytest.fixture(scope="module")
def aligned():
    a, b = build("llama", seed=0, **SIZES), build("llama", seed=1, **SIZES)
    return lambda: symgraph.align(a, b, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})


def _dense(e):
    return e.dense() if isinstance(e, Perm) else e.double()


class _Pull(Objective):
    """A loss of the elements alone: ``−Σ ⟨E, T⟩`` (each element pulled towards a fixed random
    matrix ``T``), scaled by the batch and λ so a test sees which it was given."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list = []
        self.fail_at, self.targets = fail_at, {}

    def start_loss(self, al, batches):
        self.calls.append(("start", len(batches)))
        return float(al.seconds["made"])

    def begin(self, al, elements, learn):
        self.calls.append("begin")
        g = torch.Generator().manual_seed(1)
        self.targets = {gid: torch.randn(_dense(elements[gid]).shape, generator=g, dtype=torch.float64) for gid in learn}

    def step(self, live, batch, lam):
        if len(self.calls) - 1 == self.fail_at:
            raise RuntimeError("a step failed")
        self.calls.append((batch, lam))
        loss = -sum((e * self.targets[gid]).sum() for gid, e in live.items()) * batch * lam
        loss.backward()
        return float(loss)

    def end(self):
        self.calls.append("end")

    def stored(self, elements):
        self.calls.append(("stored", sorted(elements)))
        return elements


def test_the_loop_asks_the_objective_for_each_step_and_projects_back(aligned):
    al = aligned()
    before = dict(al.elements)
    pull = _Pull()
    got = refine_elements(al, pull, [1.0, 2.0, 3.0], steps=5, lr=0.05, seed=3, progress=False)
    gen = torch.Generator().manual_seed(3)
    lams = [draw_lambda(gen) for _ in range(5)]
    assert pull.calls[0] == "begin" and pull.calls[6] == "end"
    assert pull.calls[1:6] == [(b, lam) for b, lam in zip([1.0, 2.0, 3.0, 1.0, 2.0], lams)]
    assert all(0.4 <= lam <= 0.6 for lam in lams) and len(set(lams)) == 5
    learned = pull.calls[7][1]
    assert pull.calls[7] == ("stored", learned) and got["classes"] == len(learned) >= 3 and got["steps"] == 5
    assert got["loss_first"] != got["loss_last"]
    moved = 0.0
    for gid in learned:  # exactly on the group, and moved by the steps
        E = al.elements[gid]
        if isinstance(E, Perm):
            assert sorted(E.index.tolist()) == list(range(E.index.numel()))
        else:
            eye = torch.eye(E.shape[-1], dtype=E.dtype).expand_as(E)
            assert torch.allclose(E @ E.mT, eye, atol=1e-10), gid
        moved = max(moved, float((_dense(E) - _dense(before[gid])).abs().max()))
    assert moved > 1e-2
    assert all(al.elements[g] is before[g] for g in before if g not in learned)  # heads and the rest: kept


def test_a_failed_step_still_ends_and_leaves_the_elements(aligned):
    al = aligned()
    before = dict(al.elements)
    pull = _Pull(fail_at=2)
    with pytest.raises(RuntimeError, match="a step failed"):
        refine_elements(al, pull, [1.0], steps=4, progress=False)
    assert pull.calls[0] == "begin" and pull.calls[-1] == "end" and len(pull.calls) == 4
    assert al.elements.keys() == before.keys() and all(al.elements[g] is before[g] for g in before)


def test_nothing_learnable_takes_no_step(aligned):
    al = aligned()
    al.elements = {gid: e for gid, e in al.elements.items() if gid not in learning.learnable(al.report_a, al)}
    pull = _Pull()
    assert refine_elements(al, pull, [1.0], steps=3, progress=False) == {"steps": 0, "classes": 0}
    assert pull.calls == []


def test_the_start_is_the_lower_loss_on_the_first_batches(aligned):
    starts = {}
    for name, made in (("activations", 2.5), ("weights", 1.5)):
        starts[name] = aligned()
        starts[name].seconds = {"made": made}
    pull = _Pull()
    assert choose_start(starts, pull, list(range(20))) == ("weights", {"activations": 2.5, "weights": 1.5})
    assert pull.calls == [("start", learning.START_BATCHES)] * 2
    best = learned_matching(starts, _Pull(), [1.0, 2.0], steps=2, lr=1e-3, t0=0.0, progress=False)
    assert best is starts["weights"] and best.refined["start"] == "weights" and best.refined["steps"] == 2
    assert best.refined["start_loss"] == {"activations": 2.5, "weights": 1.5}
    assert best.seconds["made"] == 2.5 and best.seconds["start"] > 0  # the first start's seconds, and the choice's


def test_optimise_is_adam_on_the_parameters_one_batch_a_step():
    """The one loop (learned matching's and learned rotations'): step ``k`` gets batch ``k mod
    len(data)`` and the elements as functions of the parameters; Adam's first step moves each
    parameter by ``lr`` against its gradient's sign; the losses come back in order."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    learn = {"g": type("L", (), {"params": [p], "element": lambda self: 2 * p})()}
    c = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    seen = []

    def step(live, batch):
        seen.append((batch, live["g"].detach().clone()))
        loss = (live["g"] * c).sum() * batch
        loss.backward()
        return float(loss)
    losses = learning.optimise(learn, step, [1.0, 3.0], steps=3, lr=0.1, progress=False)
    assert [b for b, _ in seen] == [1.0, 3.0, 1.0]
    assert torch.equal(seen[0][1], torch.tensor([2.0, -4.0, 6.0], dtype=torch.float64))
    assert torch.allclose(seen[1][1], 2 * (torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64) - 0.1 * c.sign()),
                          atol=1e-7, rtol=0)  # Adam: lr · g / (|g| + 1e-8)
    assert losses == [float((e * c).sum() * b) for b, e in seen]


def test_learned_permutations_carry_their_gradient_into_the_moved_tensors():
    """An MLP's classes are all permutations: learned matching's straight-through elements must
    reach B's moved tensors with their gradient (an index vector would drop it, and the step's
    loss would have none to go back through: ``backward`` raised). With a loss of the user's,
    ``symgraph.align`` and ``symgraph.merge`` refine them, and the same steps give the same record."""
    from types import SimpleNamespace

    from symgraph.testing.models import mlp
    from symgraph.transform.apply import move
    a, b = mlp(0), mlp(1)
    data = [torch.randn(16, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    al = symgraph.align(a, b, data[0])
    learn = learning.learnable(al.report_a, SimpleNamespace(elements=al.elements))
    assert {x.kind for x in learn.values()} == {"perm", "scaled_perm"}
    live = {gid: x.element() for gid, x in learn.items()}
    tb = {k: b.get_parameter(k).detach() for k in al.report_b.parameters}
    moved = move(al.report_b, {**al.elements, **live}, tb, al.gauge or None)
    assert moved and all(v.requires_grad for v in moved.values())
    sum(v.sum() for v in moved.values()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for x in learn.values() for p in x.params)
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    got = symgraph.align(a, b, data[0], data=data, refine=4, loss_fn=loss).refined
    assert got["steps"] == 4 and got["classes"] == 2
    merged = symgraph.merge([a, b], data=data, refine=4, loss_fn=loss).alignments[1].refined
    same = ("steps", "classes", "start", "start_loss", "loss_first", "loss_last")
    assert {k: merged[k] for k in same} == {k: got[k] for k in same}

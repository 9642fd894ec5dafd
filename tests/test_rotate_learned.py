"""Learned rotations (issue 64, SpinQuant-style): learned matching's orthogonal parametrisation
optimised on the fake-quantized loss with a straight-through estimator; the elements stay
orthogonal, the model still certifies, and the quantized loss is never worse than the start."""
from __future__ import annotations

import torch

import symgraph
from symgraph.rotation.classes import rotation_classes, rotation_elements, rotation_report
from symgraph.rotation.learned import learn_rotations, quantized_loss
from symgraph.transform.apply import stored_tensors

from test_rotate_quant import outlier_model

DATA = [{"input_ids": torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(i))} for i in range(3)]
OPTS = dict(weight_bits=4, act_bits=4, group_size=32)


def test_learned_rotations_stay_orthogonal_and_certify():
    m = outlier_model("llama")
    res = symgraph.rotate(m, how="learned", data=DATA, steps=6, lr=2e-2, keep_best=False, **OPTS)
    start = symgraph.rotate(m, how="hadamard", seed=0).elements
    assert res.learned["kept"] == "learned" and res.learned["steps"] == 6 and res.learned["classes"] == 3
    assert res.error <= 1e-5
    moved = 0.0
    for gid in res.roles["stream"] + res.roles["vo"]:
        E = res.elements[gid]
        assert float((E @ E.mT - torch.eye(E.shape[-1], dtype=E.dtype)).abs().max()) <= 1e-6
        moved = max(moved, float((E - start[gid]).abs().max()))
    assert moved > 1e-3  # learning changed the elements


def test_learned_quantized_loss_not_worse_than_the_start():
    m = outlier_model("llama")
    base, report, _ = rotation_report(m)
    start = rotation_elements(report, rotation_classes(report), "hadamard", 0)
    els, info = learn_rotations(base, report, start, DATA, steps=6, lr=2e-2, **OPTS)
    tensors = stored_tensors(report, base)
    got = quantized_loss(base, report, els, tensors, DATA, **OPTS)
    want = quantized_loss(base, report, start, tensors, DATA, **OPTS)
    assert got <= want + 1e-9
    assert info["start"] == want and min(info["start"], info["end"]) == got
    assert info["loss_first"] != info["loss_last"]


def test_learned_rotations_run_learned_matchings_loop_and_leave_the_global_generator(monkeypatch):
    """One optimiser (issue 64): the steps are :func:`symgraph.alignment.learning.optimise`'s,
    every batch in turn; nothing random is drawn, and the global generator is not reseeded."""
    from symgraph.alignment import learning
    from symgraph.rotation import learned
    calls = []

    def spy(learn, step, data, steps, lr, **kw):
        calls.append((len(learn), len(data), steps, lr, kw["desc"]))
        return real(learn, step, data, steps, lr, **kw)
    real = learning.optimise
    monkeypatch.setattr(learned, "optimise", spy)
    m = outlier_model("llama")
    base, report, _ = rotation_report(m)
    start = rotation_elements(report, rotation_classes(report), "hadamard", 0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    els, info = learn_rotations(base, report, start, DATA, steps=4, lr=2e-2, keep_best=False, **OPTS)
    assert torch.equal(torch.get_rng_state(), state)
    assert calls == [(3, 3, 4, 2e-2, "learn rotations")] and info["steps"] == 4 and info["classes"] == 3
    again, _ = learn_rotations(base, report, start, DATA, steps=4, lr=2e-2, keep_best=False, **OPTS)
    assert all(torch.equal(els[g], again[g]) for g in els)  # deterministic without a seed

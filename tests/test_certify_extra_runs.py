"""Issue 65, the certificate judges the extra runs a program is traced with: a holder run on an
injected argument (:mod:`symgraph.passes.holder_inputs`) and another method run beside the forward
(:mod:`symgraph.passes.entry_points`). The program adds them as ``0 *`` their results, so the
outputs alone never see them: a report whose transform moves everything the forward reads but
leaves the newly read parameter (a fusion layer's residual layer, a mask token, ESM's contact
regression) unmoved certifies at round-off without them (the certificate before this change),
and fails, naming the run, with them. A sound report certifies at float64 round-off."""
from __future__ import annotations

import importlib

import pytest
import torch

import symgraph
from symgraph.errors import CertificationError
from symgraph.passes.entry_points import EntryPoint
from symgraph.passes.holder_inputs import Injection
from symgraph.report.certify import extra_runs
from symgraph.testing.models import randomized

from test_entry_points import ESM
from test_holder_inputs import Fused, Masked

T = pytest.importorskip("transformers")
certify_module = importlib.import_module("symgraph.report.certify")
apply_module = importlib.import_module("symgraph.transform.apply")  # symgraph.transform is also a function


def _left_unmoved(monkeypatch, model, names: list[str]) -> None:
    """Every transform certify applies moves all but ``names``, which keep ``model``'s values."""
    real, kept = apply_module.transform, {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}
    assert set(kept) == set(names)

    def broken(m, t, *a, **kw):
        out = real(m, t, *a, **kw)
        with torch.no_grad():
            for n, v in kept.items():
                out.get_parameter(n).copy_(v.to(out.get_parameter(n).dtype))
        return out
    monkeypatch.setattr(apply_module, "transform", broken)


def _without_extra_runs(monkeypatch, rep, model) -> float:
    """The certificate as it was before extra runs were judged: the forward's outputs only."""
    with monkeypatch.context() as mp:
        mp.setattr(certify_module, "extra_runs", lambda report: [])
        return rep.certify(model)


def _holder_cases():
    torch.manual_seed(0)
    return [(Fused().eval(), (torch.randn(5, 4),), Injection("f0", "residual", index=0), ["f0.res.1.weight"]),
            (Masked().eval(), (torch.randn(2, 7, 6),), Injection("embed", "bool_masked_pos", shape=(2, 7)),
             ["embed.mask_token"])]


@pytest.mark.parametrize("case", [0, 1], ids=["fusion_residual", "mask_token"])
def test_a_holder_run_is_certified_and_a_transform_it_misses_fails(case, monkeypatch):
    m, x, injection, newly_read = _holder_cases()[case]
    rep = symgraph.analyze(m, x)
    assert extra_runs(rep) == [injection] and rep.unread is None
    assert rep.certify(m, x) < 1e-12  # float64 round-off, the injected run included
    _left_unmoved(monkeypatch, m, newly_read)
    assert _without_extra_runs(monkeypatch, rep, m) < 1e-12  # the outputs never read it
    with pytest.raises(CertificationError, match=f"{injection.path} run on its {injection.arg}") as e:
        rep.certify(m, x)
    worst = float(str(e.value).split("differ by ")[1].split()[0])
    assert worst > 1e-3


def test_the_holder_run_is_judged_through_the_outputs_not_directly():
    """The holder's run lives in its output's space, which the symmetry moves: the embeddings of
    the masked input change under a sound transform; the outputs with them in place do not."""
    m, x, injection, _ = _holder_cases()[1]
    rep = symgraph.analyze(m, x)
    B = symgraph.transform(m, rep.random_transform(seed=0))
    mask = injection.value([x[0]])
    with torch.no_grad():
        moved = float((m.embed(x[0], mask) - B.embed(x[0], mask)).abs().max())
        outputs = float((m.head(m.embed(x[0], mask)) - B.head(B.embed(x[0], mask))).abs().max())
    assert moved > 1e-2 and outputs < 1e-5


def test_certify_runs_each_injection_once_per_trial():
    m, x, _, _ = _holder_cases()[1]
    rep = symgraph.analyze(m, x)
    calls = []
    handle = m.register_forward_pre_hook(lambda mod, a: calls.append(1))  # deep copies keep it
    try:
        rep.certify(m, x, trials=3)
    finally:
        handle.remove()
    assert len(calls) == 2 * (1 + 3)  # the forward and the injected run, on the model and each trial


def test_esm_contacts_are_certified_and_unmoved_regression_columns_fail(monkeypatch):
    m = randomized(T.EsmForMaskedLM(T.EsmConfig(**ESM)))
    rep = symgraph.analyze(m)
    assert extra_runs(rep) == [EntryPoint("esm", "predict_contacts", ("main", "ones"), eager=True)]
    assert rep.certify(m) < 1e-12
    _left_unmoved(monkeypatch, m, ["esm.contact_head.regression.weight"])
    assert _without_extra_runs(monkeypatch, rep, m) < 1e-12
    with pytest.raises(CertificationError, match="values of esm.predict_contacts differ by"):
        rep.certify(m)
    assert m.config._attn_implementation == "sdpa"  # certify ran the method on its own copies


def test_a_report_without_extra_runs_has_none():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    rep = symgraph.analyze(m, (torch.randn(3, 4),))
    assert extra_runs(rep) == [] and rep.certify(m, (torch.randn(3, 4),)) < 1e-12

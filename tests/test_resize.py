"""``symgraph.resize`` and ``symgraph resize`` (issue 15): widening keeps the function exactly
(any multiplicities, even or random splits), shrinking reports its error, the config of a
Hugging Face model follows, refusals name the class."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import cli

import symgraph
from symgraph.testing import models
from symgraph.testing.models import randomize_vectors
from symgraph.width.resize import same_role


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def _out(m, x):
    with torch.no_grad():
        return m(input_ids=x).logits


def _mlp64():
    return models.mlp(0, (6, 16, 12, 3)).double()


X = torch.randn(32, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("split", ["even", "random"])
def test_widen_plain_module_exactly(split):
    A = _mlp64()
    before = {k: v.clone() for k, v in A.state_dict().items()}
    r = symgraph.analyze(A, (X,))
    hidden = [g.id for g in r.groups]  # the two hidden layers (16 and 12 units)
    res = symgraph.resize(A, {hidden[0]: 37, hidden[1]: 12 * 4}, (X,), split=split, report=r)
    B = res.model
    assert B[0].weight.shape == (37, 6) and B[0].out_features == 37
    assert B[2].weight.shape == (48, 37) and (B[2].in_features, B[2].out_features) == (37, 48)
    assert B[4].in_features == 48
    assert res.widths == {hidden[0]: (16, 37), hidden[1]: (12, 48)}
    assert res.error < 1e-12 and _rel(A(X), B(X).detach()) < 1e-12
    # every unit kept, its copies' outgoing shares sum to one
    co, contra = res.maps[hidden[0]].co, res.maps[hidden[0]].contra
    assert torch.equal(co.sum(0) >= 1, torch.ones(16, dtype=torch.bool))
    assert torch.allclose(contra.sum(0), torch.ones(16, dtype=torch.float64))
    if split == "random":
        assert len(set(contra[contra > 0].round(decimals=6).tolist())) > 3  # uneven shares
    assert all(torch.equal(before[k], v) for k, v in A.state_dict().items())  # A untouched


def test_shrink_reports_its_error_and_undoes_a_widening():
    A = _mlp64()
    r = symgraph.analyze(A, (X,))
    wide = symgraph.resize(A, {r.groups[0].id: 40}, (X,), split="random", seed=3).model
    back = symgraph.resize(wide, {r.groups[0].id: 16}, (X,))
    assert back.model[0].weight.shape == (16, 6)
    assert back.error < 1e-10  # the copies cluster together: the widening is undone exactly
    half = symgraph.resize(A, {r.groups[0].id: 8}, (X,))
    assert half.model[0].weight.shape == (8, 6)
    assert half.error == pytest.approx(_rel(A(X), half.model(X).detach()), rel=1e-9)
    assert 1e-4 < half.error < 1.0


def test_llama_mlp_and_gqa_heads_with_config(tmp_path):
    A = randomize_vectors(models.build("llama", 0), 0).double().eval()
    r = symgraph.analyze(A)
    x = torch.randint(0, A.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mlp = [g.id for g in r.groups if g.kind == "perm" and not g.outer and g.size == A.config.intermediate_size]
    assert len(mlp) == A.config.num_hidden_layers
    res = symgraph.resize(A, same_role(r, {mlp[0]: 77}), report=r)
    assert res.config == {"intermediate_size": (A.config.intermediate_size, 77)}
    assert res.error < 1e-12 and _rel(_out(A, x), _out(res.model, x)) < 1e-12
    res.model.save_pretrained(tmp_path / "w")
    again = type(A).from_pretrained(tmp_path / "w", dtype=torch.float64).eval()
    assert _rel(_out(A, x), _out(again, x)) < 1e-12
    kv = [g for g in r.groups if g.kind == "perm" and not g.outer and g.size == A.config.num_key_value_heads]
    heads = symgraph.resize(A, {g.id: 2 * g.size for g in kv}, report=r)
    assert heads.config == {"num_attention_heads": (4, 8), "num_key_value_heads": (2, 4)}
    assert _rel(_out(A, x), _out(heads.model, x)) < 1e-12


def test_gpt2_mlp_width_from_an_unset_field():
    A = randomize_vectors(models.build("gpt2", 0, n_inner=None), 0).double().eval()
    r = symgraph.analyze(A)
    mlp = [g.id for g in r.groups if g.kind == "perm" and not g.outer and g.size == 4 * A.config.n_embd]
    res = symgraph.resize(A, {g: 90 for g in mlp}, report=r)
    assert res.config == {"n_inner": (None, 90)} and res.error < 1e-12


def test_refusals_name_the_class():
    A = randomize_vectors(models.build("llama", 0), 0).eval()
    r = symgraph.analyze(A)
    stream = next(g for g in r.groups if g.kind == "orthogonal")
    fibred = next(g for g in r.groups if g.outer and g.kind == "perm")
    mlp = next(g for g in r.groups if g.kind == "perm" and g.size == A.config.intermediate_size)
    cases = [({stream.id: 64}, f"class {stream.id} .* orthogonal"),
             ({fibred.id: 16}, "fibred over a head class"),
             ({999: 4}, "no class 999"),
             ({mlp.id: 0}, "positive integer"),
             ({mlp.id: 60}, "no change of LlamaConfig's fields"),  # one layer only
             ({}, "non-empty")]
    for widths, msg in cases:
        with pytest.raises(symgraph.InputError, match=msg):
            symgraph.resize(A, widths, report=r)
    with pytest.raises(symgraph.InputError, match="split"):
        symgraph.resize(A, {mlp.id: 60}, split="uneven", report=r)


def test_widening_a_reduced_class_is_refused():
    """A permutation class that a LayerNorm reduces over cannot be widened exactly by uneven
    copies (the norm's statistics change): the check measures it and refuses. Doubling every
    unit keeps mean and variance, and is exact."""
    torch.manual_seed(0)
    A = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).double()
    r = symgraph.analyze(A, (X,), fold_norms=False)
    g = next(g for g in r.groups if g.size == 16)
    with pytest.raises(symgraph.InputError, match=f"widening class\\(es\\) \\[{g.id}\\] changes the function"):
        symgraph.resize(A, {g.id: 20}, (X,), report=r)
    doubled = symgraph.resize(A, {g.id: 32}, (X,), report=r)
    assert doubled.model[1].normalized_shape == (32,) and doubled.error < 1e-12


def test_fusion_into_a_width_smaller_than_both_parents():
    """Fuse a wide parent into a narrow one, then compress below both: the error is reported
    and the result is a working model of the target width."""
    A = _mlp64()
    B = models.mlp(1, (6, 24, 12, 3)).double()
    fused = symgraph.merge([A, B], (X,)).model
    r = symgraph.analyze(fused, (X,))
    small = symgraph.resize(fused, {r.groups[0].id: 10}, (X,))
    assert small.model[0].weight.shape == (10, 6)
    assert small.error == pytest.approx(_rel(fused(X), small.model(X).detach()), rel=1e-9)


@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_cli_resize(tmp_path):
    A = randomize_vectors(models.build("llama", 0), 0).eval()
    A.save_pretrained(tmp_path / "ck")
    r = symgraph.analyze(A)
    mlp = next(g.id for g in r.groups if g.kind == "perm" and g.size == A.config.intermediate_size)
    res = cli("resize", str(tmp_path / "ck"), "--width", f"{mlp}=80", "--every-layer",
              "--split", "random", "--out", str(tmp_path / "wide"))
    assert res.returncode == 0, res.stderr
    assert "intermediate_size 48 -> 80" in res.stdout
    meta = json.loads((tmp_path / "wide" / "symgraph_resize.json").read_text())
    assert meta["mode"] == "resize" and meta["error"] < 1e-5
    wide = type(A).from_pretrained(tmp_path / "wide").eval()
    assert wide.config.intermediate_size == 80
    x = torch.randint(0, A.config.vocab_size, (2, 7))
    assert _rel(_out(A, x), _out(wide, x)) < 1e-5
    for args, msg in (([f"{mlp}=80"], "no change of LlamaConfig"),
                      (["x=3"], "expected IDS=N"),
                      (["0=64"], "orthogonal")):
        bad = cli("resize", str(tmp_path / "ck"), "--width", *args, "--out", str(tmp_path / "bad"))
        assert bad.returncode == 2 and msg in bad.stderr and "Traceback" not in bad.stderr
        assert not (tmp_path / "bad").exists()

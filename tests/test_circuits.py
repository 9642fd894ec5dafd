"""Circuit-space merging (Theus et al. 2025) in heads N times as wide, and the untied merge."""
from __future__ import annotations

import json
import math

import pytest
import torch

import symgraph
from symgraph.core.ties import untie
from symgraph.testing import models

from conftest import cli

LLAMA = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, positions=64)
GPT2 = dict(vocab=64, hidden=32, layers=2, heads=4, positions=64)


def _logits(m, x):
    with torch.no_grad():
        return m(x).logits.double()


@pytest.fixture(scope="module")
def llama_pair():
    A = models.build("llama", **LLAMA)
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0, orthogonal=True))
    return A, B, torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 1.0])
def test_circuit_merge_of_a_transformed_copy_is_the_model(llama_pair, lam):
    A, B, x = llama_pair
    res = symgraph.merge([A, B], weights=[lam, 1 - lam], attention="circuits")
    assert res.model.config.head_dim == 2 * A.config.head_dim
    assert res.model.config.rope_parameters["rope_type"] == "longrope"
    torch.testing.assert_close(_logits(res.model, x), _logits(A, x), atol=1e-5, rtol=0)
    assert A.config.head_dim == 8 and A.config.rope_parameters["rope_type"] == "default"  # untouched


def test_circuit_endpoints_are_a_and_aligned_b_and_the_middle_is_neither():
    A = models.build("llama", seed=0, **LLAMA)
    B = models.build("llama", seed=1, **LLAMA)
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    al = symgraph.align(A, B)
    for lam, want in ((1.0, _logits(A, x)), (0.0, _logits(al.apply(B), x))):
        got = _logits(symgraph.merge([A, B], weights=[lam, 1 - lam], attention="circuits").model, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    mid = _logits(symgraph.merge([A, B], attention="circuits").model, x)
    assert (mid - _logits(A, x)).abs().max() > 1e-2


def test_three_models_give_three_fold_heads(llama_pair):
    A, B, x = llama_pair
    res = symgraph.merge([A, B, B], weights=[0.2, 0.5, 0.3], attention="circuits")
    assert res.model.config.head_dim == 3 * A.config.head_dim
    assert res.model.model.layers[0].self_attn.k_proj.weight.shape[0] == 2 * 3 * 8  # 2 KV heads
    torch.testing.assert_close(_logits(res.model, x), _logits(A, x), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_exported_circuit_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM
    A, B = models.build("llama", seed=0, **LLAMA), models.build("llama", seed=1, **LLAMA)
    for i, m in enumerate((A, B)):
        m.save_pretrained(tmp_path / f"m{i}")
    r = cli("merge", tmp_path / "m0", tmp_path / "m1", "--out", tmp_path / "out", "--attention", "circuits")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "out" / "symgraph_merge.json").read_text())
    assert meta["mode"] == "streaming" and "16 wide instead of 8" in meta["architecture"][0]  # out of core
    assert "architecture change" in (tmp_path / "out" / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=False).eval()
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    mem = symgraph.merge([A, B], attention="circuits").model
    torch.testing.assert_close(_logits(loaded, x), _logits(mem, x), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def gpt2_pair():
    A = models.build("gpt2", **GPT2)
    B = symgraph.transform(A, symgraph.analyze(A).random_transform(seed=0, orthogonal=True))
    return A, B, torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_gpt2_circuit_merge_in_memory_of_a_transformed_copy_is_the_model(gpt2_pair, lam):
    from symgraph.width.widen import Resized
    A, B, x = gpt2_pair
    before = {k: v.clone() for k, v in A.state_dict().items()}
    m = symgraph.merge([A, B], weights=[lam, 1 - lam], attention="circuits").model
    assert isinstance(m, Resized) and "no head_dim field" in m.why_not_saved
    assert m.state["transformer.h.0.attn.c_attn.weight"].shape == (32, 3 * 2 * 32)  # packed q, k, v: 2x
    assert m.state["transformer.h.1.attn.c_proj.weight"].shape == (2 * 32, 32)
    torch.testing.assert_close(_logits(m, x), _logits(A, x), atol=1e-5, rtol=0)
    y = x[:1, :7]  # another input shape: traced again, same function
    torch.testing.assert_close(_logits(m, y), _logits(A, y), atol=1e-5, rtol=0)
    assert all(torch.equal(v, A.state_dict()[k]) for k, v in before.items())  # A untouched


@pytest.mark.slow  # ~25-40 s; the default suite's budget is 10 minutes
def test_gpt2_circuit_endpoints_interpolate_and_learned_matching():
    from symgraph.merging.driver import circuit_between
    A, B = models.build("gpt2", seed=0, **GPT2), models.build("gpt2", seed=1, **GPT2)
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    al = symgraph.align(A, B)
    Bal = al.apply(B)
    for lam, want in ((1.0, _logits(A, x)), (0.0, _logits(Bal, x))):
        got = _logits(symgraph.merge([A, B], weights=[lam, 1 - lam], attention="circuits").model, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    mid = symgraph.merge([A, B], attention="circuits").model
    assert (_logits(mid, x) - _logits(A, x)).abs().max() > 1e-2

    def loss(m):
        with torch.no_grad():
            return float(m(input_ids=x, labels=x).loss)
    curve = symgraph.interpolate(A, Bal, [0.0, 0.5, 1.0], loss, attention="circuits")
    assert curve[0][1] == pytest.approx(loss(Bal), abs=1e-5) and curve[2][1] == pytest.approx(loss(A), abs=1e-5)
    assert curve[1][1] == pytest.approx(loss(mid), abs=1e-5)  # the same circuit-space model
    data = [{"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(2)]
    ref = symgraph.align(A, B, data[0], data=data, refine=3, between=circuit_between(A))
    assert ref.refined["steps"] == 3 and math.isfinite(ref.refined["loss_last"])
    torch.testing.assert_close(_logits(ref.apply(B), x), _logits(B, x), atol=1e-4, rtol=0)  # still a symmetry


@pytest.mark.slow
def test_gpt2_circuits_cannot_be_saved_and_the_cli_says_why_in_one_line(tmp_path):
    r = cli("merge", "tiny-gpt2", "tiny-gpt2", "--out", tmp_path / "o", "--attention", "circuits")
    assert r.returncode == 2 and "no head_dim field" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("symgraph:") == 1 and "in Python" in r.stderr
    assert not (tmp_path / "o").exists()


def test_untied_merge_frees_the_residual_rotation():
    G = models.build("gpt2", **GPT2)
    assert G.config.tie_word_embeddings
    U = untie(G)
    assert G.lm_head.weight is G.transformer.wte.weight  # the input is untouched
    assert U.lm_head.weight.data_ptr() != U.transformer.wte.weight.data_ptr()
    assert not U.config.tie_word_embeddings and symgraph.tied_parameters(U) == []
    x = torch.randint(0, 64, (2, 30))
    torch.testing.assert_close(_logits(U, x), _logits(G, x), atol=0, rtol=0)
    kinds = {g.kind for g in symgraph.analyze(U).groups if ("lm_head.weight", 1) in g.params}
    assert kinds == {"orthogonal_mean"}, kinds  # O(d) fixing the all-ones vector; tied: a permutation class
    assert {g.kind for g in symgraph.analyze(G).groups if ("transformer.wte.weight", 1) in g.params} == {"perm"}
    B = symgraph.transform(U, symgraph.analyze(U).random_transform(seed=1, orthogonal=True))
    res = symgraph.merge([G, untie(G)], untie=True)
    assert not res.model.config.tie_word_embeddings
    torch.testing.assert_close(_logits(res.model, x), _logits(G, x), atol=1e-5, rtol=0)
    res = symgraph.merge([U, B])
    torch.testing.assert_close(_logits(res.model, x), _logits(G, x), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_untie_is_recorded_with_its_cost(tmp_path):
    r = cli("merge", "tiny-gpt2", "tiny-gpt2", "--out", tmp_path / "o", "--untie")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "o" / "symgraph_merge.json").read_text())
    assert meta["options"]["untie"] is True
    assert "4096 more parameters" in meta["architecture"][0]  # 128 tokens x 32 wide

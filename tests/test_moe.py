"""Mixture-of-experts decoders (issue 14): the router's top-k labels the experts, so the expert
order is a permutation class (router rows, every stacked expert weight's first axis), each
block's hidden units are a class, and the residual stream flows through the routed sum
(orthogonal, with the norm gains folded into the router and the stacked gate/up weights).
Certified in float64, recovered exactly from a transformed copy, merged with it into itself.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import symgraph

transformers = pytest.importorskip("transformers")

E, K, D, I = 4, 2, 16, 12


def ids():
    return {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}


def randomized(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # HF initialises norms to ones and some weights to zero
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def olmoe():
    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=D, intermediate_size=I,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   num_experts=E, num_experts_per_tok=K, use_cache=False,
                                   max_position_embeddings=32)
    return transformers.OlmoeForCausalLM(cfg)


def qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=D, intermediate_size=24,
                                      moe_intermediate_size=I, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                      num_experts=E, num_experts_per_tok=K, use_cache=False,
                                      max_position_embeddings=32)
    return transformers.Qwen3MoeForCausalLM(cfg)


def mixtral():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=D, intermediate_size=I,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=E,
                                     num_experts_per_tok=K, use_cache=False,
                                     max_position_embeddings=32)
    return transformers.MixtralForCausalLM(cfg)


def only(report, param, dim):
    (g,) = report.group_of(param, dim)
    return g


@pytest.mark.parametrize("build", [olmoe, qwen3_moe, mixtral])
def test_moe_groups_certified_and_recovered(build):
    model = randomized(build()).double()
    impl = model.config._experts_implementation
    r = symgraph.analyze(model, ids())
    assert model.config._experts_implementation == impl  # traced as batched_mm, then restored
    assert r.frozen == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float64 runs: no float32 fallback
        assert r.certify(model, ids()) < 1e-6
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        experts = only(r, f"{mlp}.gate.weight", 0)  # the router's rows are the experts
        assert (experts.kind, experts.size) == ("perm", E)
        assert {(f"{mlp}.experts.gate_up_proj", 0), (f"{mlp}.experts.down_proj", 0)} <= set(experts.params)
        hidden = only(r, f"{mlp}.experts.down_proj", 2)
        assert (hidden.kind, hidden.size) == ("perm", I)
        assert r.axis_structure(r.param_axes(f"{mlp}.experts.gate_up_proj")[1]) == ("sum", [I, I])
        assert r.group_of(f"{mlp}.experts.gate_up_proj", 1) == [hidden]
    stream = only(r, "model.embed_tokens.weight", 1)
    assert stream.kind == "orthogonal" and stream.size == D
    assert ("model.layers.1.mlp.experts.gate_up_proj", 2) in stream.params
    folded = {w for f in r.folds for w, _, _ in f.readers}
    assert "model.layers.0.mlp.experts.gate_up_proj" in folded

    moved = symgraph.transform(model, r.random_transform(seed=3, orthogonal=True))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(moved.state_dict()[gate], model.state_dict()[gate])
    al = symgraph.align(model, moved, ids())
    got, want = al.apply(moved).state_dict(), model.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-9
    merged = symgraph.merge([model, moved], ids()).model.state_dict()
    assert max((merged[k] - want[k]).abs().max().item() for k in want) < 1e-9


class _Router(torch.nn.Module):
    """Top-k routing whose labels feed both a gather (fine) and ``one_hot`` arithmetic."""

    def __init__(self, numbers):
        super().__init__()
        self.numbers = numbers
        self.router = torch.nn.Linear(D, E, bias=False)
        self.w = torch.nn.Parameter(torch.randn(E, I, D))
        self.out = torch.nn.Linear(I, 3)

    def forward(self, x):
        top = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        idx = top.indices.reshape(-1)
        h = torch.bmm(self.w[idx], x.repeat_interleave(K, 0).unsqueeze(-1)).squeeze(-1)
        y = self.out(torch.relu(h) * top.values.reshape(-1, 1))
        if self.numbers:  # the labels read as numbers: which expert, one-hot, as a feature
            y = y + torch.nn.functional.one_hot(idx, E).float()[:, :3]
        return y


@pytest.mark.parametrize("numbers", [False, True])
def test_labels_read_as_numbers_fix_the_experts(numbers):
    torch.manual_seed(0)
    m, x = _Router(numbers).eval(), torch.randn(5, D)
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < 1e-6
    experts = r.group_of("router.weight", 0)
    if numbers:
        assert experts == [] and r.group_of("w", 0) == []
        an = r._analysis  # the reason names the op that read the labels (one_hot's eq)
        reasons = an.uf.reasons[an.uf.find(r.param_axes("w")[0])[0]]
        assert any(k == "identity" and "reads the labels" in w for k, w in reasons)
    else:
        (g,) = experts
        assert g.kind == "perm" and ("w", 0) in g.params

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
from symgraph.testing.models import randomized as shared_randomized

transformers = pytest.importorskip("transformers")

E, K, D, I = 4, 2, 16, 12


def ids():
    return {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}



def randomized(model, seed=0):
    """HF initialises norms to ones and some weights to zero: every parameter drawn, float32."""
    return shared_randomized(model, seed, dtype=torch.float32)


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


@pytest.mark.parametrize("build", [pytest.param(olmoe, marks=pytest.mark.slow), qwen3_moe,
                                   pytest.param(mixtral, marks=pytest.mark.slow)])  # two of three: slow (25 s each)
@pytest.mark.slow
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
        # each expert's hidden units are its own class: fibred over the experts, with the
        # stacked weights viewed as (experts × hidden) on one axis
        hidden = only(r, f"{mlp}.experts.down_proj", 2)
        assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", I, E, [experts.id])
        assert r.stacked[f"{mlp}.experts.gate_up_proj"] == (0, 1)
        assert r.stacked[f"{mlp}.experts.down_proj"] == (0, 2)
        assert r.axis_structure(r.param_axes(f"{mlp}.experts.gate_up_proj")[0]) == ("prod", [E, 2 * I])
        assert r.group_of(f"{mlp}.experts.gate_up_proj", 1) == [hidden]
        assert r.group_of(f"{mlp}.experts.gate_up_proj", 0) == [experts]
    stream = only(r, "model.embed_tokens.weight", 1)
    assert stream.kind == "orthogonal" and stream.size == D
    assert r.group_of("model.layers.1.mlp.experts.gate_up_proj", 2) == [stream]
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


class _Experts(torch.nn.Module):
    """Stacked experts read through the router's labels on the way in and out; ``shared``
    adds one bias over every expert's hidden units, which ties their orders together."""

    def __init__(self, shared):
        super().__init__()
        self.router = torch.nn.Linear(D, E, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(E, I, D))
        self.w_out = torch.nn.Parameter(torch.randn(E, D, I))
        self.bias = torch.nn.Parameter(torch.randn(I)) if shared else None

    def forward(self, x):
        top = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        idx = top.indices.reshape(-1)
        xs = x.repeat_interleave(K, 0)
        h = torch.bmm(self.w_in[idx], xs.unsqueeze(-1)).squeeze(-1)
        if self.bias is not None:
            h = h + self.bias
        y = torch.bmm(self.w_out[idx], torch.nn.functional.silu(h).unsqueeze(-1)).squeeze(-1)
        return (y * top.values.reshape(-1, 1)).reshape(-1, K, D).sum(1)


@pytest.mark.parametrize("shared", [False, True])
def test_each_expert_has_its_own_hidden_class(shared):
    torch.manual_seed(0)
    m, x = _Experts(shared).double().eval(), torch.randn(6, D, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < 1e-9
    (experts,) = r.group_of("router.weight", 0)
    (hidden,) = r.group_of("w_in", 1)
    assert r.group_of("w_out", 2) == [hidden] and r.group_of("w_in", 0) == [experts]
    if shared:  # a tensor with the hidden units and no expert: one order for all experts
        assert (hidden.blocks, hidden.outer, r.stacked) == (1, [], {})
        assert r.group_of("bias", 0) == [hidden]
        return
    assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", I, E, [experts.id])
    assert r.stacked == {"w_in": (0, 1), "w_out": (0, 2)}
    # one expert's units permuted alone keeps the function; the same map on all does not
    # reach it: recovery must undo a different permutation per expert
    t = r.random_transform(seed=1)
    P = t.elements[hidden.id]
    assert P.shape == (E, I, I) and not all(torch.equal(P[0], P[e]) for e in range(1, E))
    moved = symgraph.transform(m, t)
    assert (moved(x) - m(x)).abs().max() < 1e-12
    al = symgraph.align(m, moved, (x,))
    got = al.apply(moved).state_dict()
    assert max((got[k] - v).abs().max().item() for k, v in m.state_dict().items()) < 1e-12
    # the stored layout: expert e's rows of w_in are permuted by P[e] only
    back = r.unview("w_in", r.view("w_in", m.w_in.detach()))
    assert torch.equal(back, m.w_in.detach())
    # expert e's rows are permuted by its own P[e], then land where the expert order puts them
    W, moved_w = m.w_in.detach(), moved.w_in.detach()
    for f, e in enumerate(t.elements[experts.id].index.tolist()):
        assert torch.equal(moved_w[f], P[e] @ W[e])


def test_experts_too_large_for_per_expert_classes_share_one(monkeypatch):
    """Per-expert elements cost (experts × units)² entries; past the limit the hidden class is
    one permutation for all experts (a subgroup: still certified), and the report says so."""
    from symgraph.passes.patterns import stacked
    monkeypatch.setattr(stacked, "MAX_STACKED", (E * I) ** 2 - 1)
    torch.manual_seed(0)
    m, x = _Experts(False).double().eval(), torch.randn(6, D, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    (hidden,) = r.group_of("w_in", 1)
    assert (hidden.blocks, hidden.outer, r.stacked) == (1, [], {})
    assert "one order for all 4 members" in r.shared[hidden.id] and r.shared[hidden.id] in r.summary()
    assert r.certify(m, (x,)) < 1e-9

"""Issue 65: a mixture of experts traced with the values its data decides (a router's choice,
:mod:`symgraph.passes.real_values`) routes the example tokens as the eager model does.

Switch Transformers and LongCat-Flash traced, certified and claimed nothing: torch 2.13 gives
every ``nn.Parameter`` uninitialised memory as its real value in that mode (its
``meta_utils._safe_copy`` copies plain tensors only), so the router's choice was taken from
garbage (every token to one expert, capacity-capped) and the experts the eager run reads were
left unread, which fixes every class. The example tokens were never the cause: the eager run on
them reads every expert.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.nodes import UNREAD
from symgraph.passes.trace import trace
from tiny_modules import ExpertLoop, experts_claimed


def _groups_holding(rep, slot):
    return [g for g in rep.groups if slot in g.params]


def Top1(n=3):
    """A top-1 router (its weights pick expert ``i`` for a token largest in channel ``i``) and
    a loop over the experts it picked, each named by its index (Switch Transformers)."""
    model = ExpertLoop(4, n)
    with torch.no_grad():
        model.router.weight.copy_(torch.eye(n, 4))
    return model


def _tokens():
    """Eight tokens: one for expert 0, two for expert 1, five for expert 2."""
    torch.manual_seed(0)
    x = torch.rand(8, 4) * 0.1
    for i, e in enumerate([0, 1, 1, 2, 2, 2, 2, 2]):
        x[i, e] = 1.0 + i
    return x.reshape(2, 4, 4)


def test_the_traced_router_routes_as_the_eager_one():
    model = Top1().eval()
    x = _tokens()
    counts = torch.bincount(model.router(x.reshape(-1, 4)).argmax(-1), minlength=3)
    assert counts.tolist() == [1, 2, 5]
    ep, _, _ = trace(model, (x,))
    assert ep.graph_module.meta[UNREAD] == []  # every expert is read, as in the eager run
    # the program asserts each expert's rows the example's: it runs on the example, and agrees
    with torch.no_grad():
        assert torch.allclose(ep.module()(x), model(x), atol=1e-6)
    experts_claimed(model, x)


transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_switch_transformers_experts_each_claimed():
    from transformers.models.switch_transformers import modeling_switch_transformers as switch
    cfg = transformers.SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, expert_capacity=8)
    torch.manual_seed(0)
    mlp = switch.SwitchTransformersSparseMLP(cfg).eval()
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        chosen, _, _ = mlp.router(x)
    assert (chosen.sum((0, 1)) > 0).all()  # the eager run reads every expert
    ep, _, _ = trace(mlp, (x,))
    assert ep.graph_module.meta[UNREAD] == []
    rep = symgraph.analyze(mlp, (x,))
    for i in range(4):
        (hidden,) = _groups_holding(rep, (f"experts.expert_{i}.wi.weight", 0))
        assert hidden.kind == "scaled_perm" and hidden.size == 24  # ReLU: positive homogeneity
        assert (f"experts.expert_{i}.wo.weight", 1) in hidden.params
    assert rep.certify(mlp, (x,)) <= 1e-6


@pytest.mark.slow
def test_a_second_router_routes_on_the_first_mixtures_real_output():
    """Switch's experts add into their output in place (``index_add_``); a second mixture's
    router reads that output, so its real value must be the sum, not the zeros it started as."""
    from transformers.models.switch_transformers import modeling_switch_transformers as switch
    cfg = transformers.SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, expert_capacity=8)
    torch.manual_seed(0)
    first, second = (switch.SwitchTransformersLayerFF(cfg, is_sparse=True) for _ in range(2))
    model = nn.Sequential(first, second).eval()
    x = torch.randn(2, 8, 16)
    with torch.no_grad():  # eager: every expert of both is read
        assert (first.mlp.router(first.layer_norm(x))[0].sum((0, 1)) > 0).all()
        assert (second.mlp.router(second.layer_norm(first(x)))[0].sum((0, 1)) > 0).all()
    ep, _, _ = trace(model, (x,))
    assert ep.graph_module.meta[UNREAD] == []
    with torch.no_grad():  # the sizes it asserts are the example's: it runs on it, and agrees
        assert torch.allclose(ep.module()(x), model(x), atol=1e-6)

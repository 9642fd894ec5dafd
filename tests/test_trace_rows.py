"""Issue 65, the rows that failed in ``torch.export`` or in the eager run on a cache call.

- A hybrid decoder whose layers are all linear attention (Qwen3.5, GraniteMoeHybrid at two
  layers) builds a cache from its config's ``use_cache`` when its forward is not told otherwise,
  and that cache cannot say how long it is (``get_seq_length``: "can only be called on Attention
  layers"): its forward takes ``use_cache`` only through ``**kwargs``, and the example inputs
  pass ``use_cache=False`` that way too.
- A forward whose sizes the data decides inside a branch on its data (Longformer's global
  attention, Switch Transformers' loop over the experts its router picked) is traced with real
  values (:mod:`symgraph.passes.real_values`): torch's own checks of that mode no longer trip on a
  boolean mask's selection, an iteration over ``nonzero``'s rows or an expert named by a tensor.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.passes.trace import trace
from symgraph.testing.models import randomized


def _groups_holding(rep, slot):
    return [g for g in rep.groups if slot in g.params]


class GlobalRows(nn.Module):
    """An MLP whose rows at the tokens a mask marks get an extra projection, taken only when the
    mask marks some token (Longformer's global attention): the selection's size is the data's,
    and ``einsum`` (no rule: decomposed after the trace) reads it."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.extra = nn.Linear(6, 12), nn.Linear(12, 6), nn.Linear(6, 6)

    def forward(self, x, mask):
        h = self.down(torch.relu(self.up(x)))
        if mask.flatten().any().item():
            rows, cols = mask.nonzero(as_tuple=True)
            picked = self.extra(x[rows, cols])
            h = h.index_put((rows, cols), torch.einsum("nd,n->nd", picked, torch.ones(picked.shape[0])),
                            accumulate=True)
        return h


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class ExpertLoop(nn.Module):
    """A top-1 router and a loop over the experts it picked, each named by its index (Switch
    Transformers): ``for e in hit: self.experts[f"expert_{e[0]}"]``."""

    def __init__(self, n=3):
        super().__init__()
        self.router = nn.Linear(8, n, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": Expert() for i in range(n)})

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        picked = nn.functional.one_hot(self.router(flat).argmax(-1), len(self.experts))
        out = torch.zeros_like(flat)
        for e in (picked.sum(0) > 0).nonzero():
            rows = picked[:, e[0]].nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.experts[f"expert_{e[0]}"](flat[rows]))
        return (flat + out).reshape(x.shape)


def test_a_masked_selection_inside_a_data_branch_traces_and_certifies():
    torch.manual_seed(0)
    model = GlobalRows().eval()
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 0] = mask[1, 3] = True
    inp = {"x": torch.randn(2, 5, 6), "mask": mask}
    ep, _, _ = trace(model, inp)
    # the selection's size is the example's, asserted in the program; einsum was decomposed
    assert any(n.target is torch.ops.aten._assert_scalar.default for n in ep.graph.nodes)
    assert not any(n.target is torch.ops.aten.einsum.default for n in ep.graph.nodes)
    rep = symgraph.analyze(model, inp)
    (hidden,) = _groups_holding(rep, ("up.weight", 0))
    assert hidden.kind in ("perm", "scaled_perm") and hidden.size == 12
    assert {("down.weight", 1), ("up.bias", 0)} <= set(hidden.params)
    assert rep.certify(model, inp) <= 1e-6


def test_a_loop_over_the_experts_a_router_picked_traces_and_certifies():
    torch.manual_seed(0)
    model = ExpertLoop().eval()
    x = torch.randn(2, 6, 8)
    hit = set(model.router(x.reshape(-1, 8)).argmax(-1).tolist())
    assert hit == {0, 1, 2}  # every expert is read: none is left fixed as unread
    rep = symgraph.analyze(model, (x,))
    for i in range(3):
        (hidden,) = _groups_holding(rep, (f"experts.expert_{i}.wi.weight", 0))
        assert hidden.kind in ("perm", "scaled_perm") and hidden.size == 16
        assert (f"experts.expert_{i}.wo.weight", 1) in hidden.params
    assert rep.certify(model, (x,)) <= 1e-6


transformers = pytest.importorskip("transformers")


def _hybrid():
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=16,
        layer_types=["linear_attention", "linear_attention"], mamba_n_heads=4, mamba_d_state=8,
        mamba_d_head=16, mamba_n_groups=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(0)
    return randomized(transformers.GraniteMoeHybridForCausalLM(cfg).eval()).float()  # grouped_mm: no float64


def test_a_hybrid_without_attention_layers_gets_caches_off_through_its_kwargs():
    m = _hybrid()
    assert m.config.use_cache  # its config asks for a cache, which no attention layer could size
    args, kwargs = default_inputs(m)
    import inspect
    assert "use_cache" not in inspect.signature(m.forward).parameters and kwargs["use_cache"] is False
    with torch.no_grad():
        out = m(*args, **kwargs)
    assert out.logits.shape == (*kwargs["input_ids"].shape, 64)
    rep = symgraph.analyze(m)
    (mlp,) = _groups_holding(rep, ("model.layers.0.shared_mlp.output_linear.weight", 1))
    assert mlp.kind == "perm" and mlp.size == 16
    assert rep.certify(m) <= 1e-6

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

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.passes.trace import trace
from symgraph.testing.models import randomized
from tiny_modules import ExpertLoop, MaskBranch, experts_claimed


def _groups_holding(rep, slot):
    return [g for g in rep.groups if slot in g.params]


class GlobalRows(MaskBranch):
    """An MLP whose rows at the tokens a mask marks get an extra projection, taken only when the
    mask marks some token (Longformer's global attention): the selection's size is the data's,
    and ``einsum`` (no rule: decomposed after the trace) reads it."""

    def extra_term(self, h, x, mask):
        rows, cols = mask.nonzero(as_tuple=True)
        picked = self.extra(x[rows, cols])
        return h.index_put((rows, cols), torch.einsum("nd,n->nd", picked, torch.ones(picked.shape[0])),
                           accumulate=True)


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
    model = ExpertLoop(8).eval()
    x = torch.randn(2, 6, 8)
    hit = set(model.router(x.reshape(-1, 8)).argmax(-1).tolist())
    assert hit == {0, 1, 2}  # every expert is read: none is left fixed as unread
    experts_claimed(model, x)


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

"""Issue 65: a draft model for assisted decoding that reads its target model's key/value states
(Gemma 4's assistant: ``shared_kv_states``, and the target's hidden states as ``inputs_embeds``)
gets them in its example inputs, shaped as its own attention modules read them, so
``symgraph.analyze(model)`` needs no inputs: it refused to run on token ids alone."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

T = pytest.importorskip("transformers")
BACKBONE = 48


def _assistant():
    text = T.CONFIG_MAPPING["gemma4_unified_text"](
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=2)
    cfg = T.CONFIG_MAPPING["gemma4_unified_assistant"](text_config=text.to_dict(), backbone_hidden_size=BACKBONE)
    torch.manual_seed(0)
    return randomized(T.Gemma4UnifiedAssistantForCausalLM(cfg)).eval()


def test_states_shaped_as_each_layer_type_reads_them_and_embeddings_as_wide_as_its_projection():
    m = _assistant()
    _, kw = default_inputs(m)
    attn = {a.layer_type: a for a in m.modules() if hasattr(a, "layer_type") and hasattr(a, "head_dim")}
    assert set(kw["shared_kv_states"]) == set(attn) == {"sliding_attention", "full_attention"}
    for kind, (k, v) in kw["shared_kv_states"].items():
        assert k.shape == v.shape == (2, 4 // attn[kind].num_key_value_groups, 8, attn[kind].head_dim)
    assert kw["inputs_embeds"].shape == (2, 8, 2 * BACKBONE) == (2, 8, m.pre_projection.in_features)
    with torch.no_grad():
        assert m(**kw).logits.shape == (2, 8, 64)


def test_assistant_analysed_without_inputs_certifies_and_is_recovered():
    m = _assistant()
    r = symgraph.analyze(m)
    assert r.unread is None
    up = [g for g in r.group_of("model.layers.0.mlp.up_proj.weight", 0) if g.kind == "perm"]
    assert [g.size for g in up] == [48]
    assert r.certify(m) <= 1e-6
    moved = symgraph.transform(m, r.random_transform(seed=3))
    back = symgraph.align(m, moved).apply(moved).state_dict()
    want, was = m.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1  # the draw moved it
    assert max((back[k] - want[k]).abs().max().item() for k in want) < 1e-6  # recovered by weights


def test_a_model_that_takes_no_shared_states_gets_none():
    m = randomized(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                                    num_hidden_layers=1, num_attention_heads=4,
                                                    num_key_value_heads=2, max_position_embeddings=32)))
    assert set(default_inputs(m)[1]) == {"input_ids", "use_cache"}

"""An alignment, a transform or a certificate is refused for a model of another architecture than
the report's, even where the tensors' names and shapes agree (Qwen3's per-head query and key
norms beside Llama), and still taken for the model it was computed from."""
from __future__ import annotations

import pytest
import torch
import transformers as T

import symgraph
from symgraph.errors import InputError
from symgraph.testing import models

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def three():
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    cfg = T.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    q = T.Qwen3ForCausalLM(cfg).eval()
    return a, b, q


def test_another_architecture_is_refused(three):
    a, b, q = three
    al = symgraph.align(a, b)
    with pytest.raises(InputError, match="model_b is a Qwen3ForCausalLM, but the report was computed from a Llama"):
        al.apply(q)
    t = symgraph.analyze(a).random_transform(seed=0)
    with pytest.raises(InputError, match="transform's model is a Qwen3ForCausalLM"):
        symgraph.transform(q, t)
    with pytest.raises(InputError, match="the model to certify is a Qwen3ForCausalLM"):
        symgraph.analyze(a).certify(q)


def test_extra_parameters_are_refused(three):
    a, b, _ = three
    al = symgraph.align(a, b)
    b2 = models.build("llama", seed=1, **L)
    b2.register_parameter("stray", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(InputError, match="parameters its report does not name \\('stray'\\)"):
        al.apply(b2)


def test_the_models_own_architecture_is_taken(three):
    a, b, _ = three
    al = symgraph.align(a, b)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    fine_tune = models.build("llama", seed=7, **L)  # B's architecture, other weights
    moved = al.apply(fine_tune)
    with torch.no_grad():
        assert torch.allclose(moved(x).logits, fine_tune(x).logits, atol=1e-5)
    assert symgraph.analyze(a).certify(a) < 1e-6

"""A matmul by a transposed 2-d parameter (``x @ W.T``: Falcon's ``FalconLinear``) is a linear
layer like ``F.linear``: RegMean takes its inputs' Gram and REPAIR corrects the channels it
produces (the transposed weight read again once corrected)."""
from __future__ import annotations

import pytest
import torch
import transformers as T

import symgraph

CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
           multi_query=True, max_position_embeddings=64)


@pytest.fixture(scope="module")
def falcons():
    out = []
    for s in (0, 1):
        torch.manual_seed(s)
        out.append(T.FalconForCausalLM(T.FalconConfig(**CFG)).eval())
    return out


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, 64, (8, 12), generator=g)} for _ in range(3)]


def test_every_falcon_linear_is_found(falcons):
    layers = {w: layout for w, _, _, layout in symgraph.analyze(falcons[0]).linear_layers()}
    for i in range(2):
        for m in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            assert layers[f"transformer.h.{i}.{m}.weight"] == "out_in"


def test_regmean_moves_the_transposed_linears(falcons, data):
    avg = symgraph.merge(falcons, data=data).model.state_dict()
    reg = symgraph.merge(falcons, method="regmean", data=data).model.state_dict()
    moved = {k for k in avg if not torch.equal(avg[k], reg[k])}
    assert {f"transformer.h.{i}.mlp.dense_4h_to_h.weight" for i in range(2)} <= moved
    assert "transformer.h.0.input_layernorm.weight" not in moved


def test_repair_corrects_the_channels_of_x_at_w_transposed(falcons, data):
    res = symgraph.merge(falcons, align="activations", data=data, repair=True)
    fixed = {layer.weight: layer for layer in res.repair.layers}
    assert set(fixed) == {f"transformer.h.{i}.mlp.dense_h_to_4h.weight" for i in range(2)}
    for layer in fixed.values():  # the corrected layer's statistics reach the target
        assert layer.after < 1e-6 < 0.01 < layer.before

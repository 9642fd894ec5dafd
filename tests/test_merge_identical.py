"""Merging a model with copies of itself gives the model back, for every method that takes
statistics, on models where that used to fail: a ReLU unit no data reaches (RegMean solved its
column to zero), BatchNorm running statistics (no gradient: Fisher averages them), and an
encoder-decoder whose traced ``view`` meets another layout under autograd (Fisher's backward)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import symgraph


def relu_mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 5)).eval()
    with torch.no_grad():  # hidden unit 3 of the second layer never fires
        m[2].weight[3].zero_()
        m[2].bias[3] = -1.0
    return m, [(torch.randn(8, 10, generator=torch.Generator().manual_seed(i)),) for i in range(3)]


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        return self.fc(torch.relu(self.b2(self.c2(x))).mean((2, 3)))


def bn_cnn():
    torch.manual_seed(0)
    m = CNN().eval()
    with torch.no_grad():
        for bn in (m.b1, m.b2):
            bn.running_mean.normal_(0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m, [(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(i)),) for i in range(3)]


def t5():
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4)
    g = torch.Generator().manual_seed(0)
    return T.T5ForConditionalGeneration(cfg).eval(), [
        {"input_ids": torch.randint(2, 64, (4, 8), generator=g), "decoder_input_ids": torch.randint(2, 64, (4, 6), generator=g)}
        for _ in range(2)]


@pytest.mark.parametrize("build, method", [(relu_mlp, "regmean"), (relu_mlp, "fisher"), (bn_cnn, "fisher"),
                                           (bn_cnn, "regmean"), (t5, "fisher")])
def test_a_model_merged_with_itself_is_the_model(build, method):
    m, data = build()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = symgraph.merge([m, copy.deepcopy(m), copy.deepcopy(m)], method=method, data=data, align=None).model
    for k, v in out.state_dict().items():
        assert torch.allclose(v, before[k], atol=1e-6, rtol=1e-5), k
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # the input untouched


def test_regmean_keeps_the_average_where_no_input_reaches():
    a, data = relu_mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.1 * torch.randn_like(p))
        b[2].weight[3].zero_()
    out = symgraph.merge([a, b], method="regmean", data=data, align=None).model
    dead = out[4].weight[:, 3]
    assert torch.allclose(dead, (a[4].weight[:, 3] + b[4].weight[:, 3]) / 2, atol=1e-6)
    assert dead.abs().max() > 0.01


def test_fisher_without_eps_averages_what_no_data_moves():
    from symgraph.testing import models
    L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    data = [{"input_ids": torch.tensor([[3, 5, 7, 9]])}]  # four of 64 tokens: the other rows get no gradient
    out = symgraph.merge([a, b], method="fisher", method_options={"eps": 0.0}, data=data, align=None).model
    emb = out.model.embed_tokens.weight
    assert torch.isfinite(emb).all()
    avg = (a.model.embed_tokens.weight + b.model.embed_tokens.weight) / 2
    assert torch.allclose(emb[20], avg[20], atol=1e-7) and not torch.allclose(emb[3], avg[3], atol=1e-4)

"""Issue 65, completeness and dead code: an MLP or attention site whose values reach no output
the report keeps (LLaVA's last vision layer when its features come from the one before, SigLIP's
pooling head beside a mean-pooling classifier) is not expected to hold a class; the analysis
fixes its weights, and every live unit is still expected."""
from __future__ import annotations

import types

import torch
import torch.nn as nn

import symgraph
from benchmarks.coverage.structure import expectations, mlp_units
from symgraph.passes.trace import trace


class Layer(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 16), nn.Linear(16, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.relu(self.up(x)))


class Tower(nn.Module):
    """Two layers; the logits are taken after the first (``feature_layer=-2``) unless ``last``;
    the last layer's states are returned as hidden states, which a head model's report does not
    keep (so the graph holds the last layer, but no kept output depends on it)."""

    def __init__(self, last: bool):
        super().__init__()
        self.last, self.inp, self.layers, self.head = last, nn.Linear(5, 8), nn.ModuleList([Layer(), Layer()]), nn.Linear(8, 3)

    def forward(self, x):
        states = [self.inp(x)]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return {"logits": self.head(states[-1] if self.last else states[-2]), "hidden_states": states[-1]}


def run(last: bool):
    torch.manual_seed(0)
    model, inputs = Tower(last).double().eval(), (torch.randn(2, 4, 5, dtype=torch.float64),)
    report = symgraph.analyze(model, inputs)
    assert report.certify(model, inputs) < 1e-12
    ep = trace(model, inputs)[0]
    return ep, report, expectations(ep, report, types.SimpleNamespace())


def test_the_layer_past_the_features_is_dead_and_not_expected():
    ep, report, st = run(last=False)
    assert st["missing"] == []
    assert st["mlps"] == 1 and st["attention"] == 1 and st["dead_attention"] == 1
    assert [u["down"][0] for u in mlp_units(ep)] == ["layers.0.down.weight", "layers.1.down.weight"]
    # the analysis fixes the dead layer's weights: no class holds them
    held = {p for g in report.groups for p, _ in g.params}
    assert "layers.1.up.weight" not in held and "layers.0.up.weight" in held


def test_every_live_unit_is_still_expected():
    _, _, st = run(last=True)
    assert st["missing"] == [] and st["mlps"] == 2 and st["attention"] == 2 and st["dead_attention"] == 0

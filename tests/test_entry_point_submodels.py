"""Issue 65, a sub-model the forward never calls (:mod:`symgraph.passes.entry_points`): a speech
model's codec turns audio into the codes its language model takes only in ``generate``, so the
forward never reads it (Kyutai's Mimi). A module with a config and a main input of its own runs
its forward beside the model's on its own example inputs (from its config, made in the program
from their shapes alone), its results kept fixed: its parameters are read, its own classes are
found and certified, the model's forward stays exact on another batch, and a moved copy is
recovered by weight matching. Without the run, the unread codec fixed every class."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.entry_points import OWN, EntryPoint, entry_points, own_value
from symgraph.passes.holder_inputs import HOLDERS
from symgraph.passes.trace import flatten_outputs
from symgraph.testing.models import randomized

from test_holder_inputs import recovered

T = pytest.importorskip("transformers")

VIT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, image_size=8,
           patch_size=4, num_channels=3)


class WithCodec(torch.nn.Module):
    """An MLP over features; ``codec``, a vision transformer of its own config, never called."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 10), torch.nn.Linear(10, 3)
        self.codec = T.ViTModel(T.ViTConfig(**VIT))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def test_a_sub_model_never_called_runs_on_its_own_inputs():
    torch.manual_seed(0)
    m, x = randomized(WithCodec()).eval(), torch.randn(2, 4, dtype=torch.float64)
    unread = [f"codec.{n}" for n, _ in m.codec.named_parameters()]
    want = EntryPoint("codec", "forward", (OWN + "pixel_values",), own=(("pixel_values", (2, 3, 8, 8), True),))
    assert entry_points(m, (x,), {}, unread) == [want]
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and rep.exported_program.graph_module.meta[HOLDERS] == [want]
    (mlp,) = rep.group_of("codec.layers.0.mlp.fc1.weight", 0)
    assert mlp.kind == "perm" and mlp.size == 24  # the codec's own hidden units
    assert [(g.kind, g.size) for g in rep.group_of("codec.layers.0.attention.v_proj.weight", 0)] == [
        ("perm", 2), ("gl", 16)]  # its heads
    (hidden,) = rep.group_of("up.weight", 0)
    assert hidden.kind == "signed_perm" and hidden.size == 10  # tanh is odd
    assert rep.certify(m, (x,)) <= 1e-6
    other = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, plain = flatten_outputs(rep.exported_program.module()(other)), flatten_outputs(m(other))
    assert max(float((a - b).abs().max()) for a, b in zip(got, plain)) < 1e-12  # the plain forward
    assert recovered(m, rep, (x,)) < 1e-5


def test_own_inputs_are_the_same_on_every_run_and_vary():
    m = torch.nn.Linear(2, 2).double()
    a, b = own_value((2, 1, 50), True, m, "cpu"), own_value((2, 1, 50), True, m, "cpu")
    assert a.dtype == torch.float64 and torch.equal(a, b) and a.unique().numel() > 90
    assert torch.equal(own_value((2, 3), False, m, "cpu"), torch.zeros(2, 3, dtype=torch.long))

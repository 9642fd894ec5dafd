"""Issue 65, a sub-model the forward never calls (:mod:`symgraph.passes.entry_points`): a speech
model's codec turns audio into the codes its language model takes only in ``generate``, so the
forward never reads it (Kyutai's Mimi). A module with a config and a main input of its own runs
its forward beside the model's on its own example inputs (from its config, made in the program
from their shapes alone), its results kept fixed: its parameters are read, its own classes are
found and certified, the model's forward stays exact on another batch, and a moved copy is
recovered by weight matching. Without the run, the unread codec fixed every class. Only a
sub-model that makes codes runs: a tower whose results are all floating could feed
``generate`` states the model's moving axes read, so it stays unread."""
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
DAC = dict(encoder_hidden_size=4, downsampling_ratios=[2, 2], decoder_hidden_size=8, n_codebooks=2,
           codebook_size=8, codebook_dim=4, hidden_size=16, upsampling_ratios=[2, 2], sampling_rate=800)


class WithCodec(torch.nn.Module):
    """An MLP over features; ``codec``, a sub-model of its own config, never called: a DAC
    codec (audio in, codes out) or, with ``tower``, a vision transformer (states out)."""

    def __init__(self, tower: bool = False):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 10), torch.nn.Linear(10, 3)
        self.codec = T.ViTModel(T.ViTConfig(**VIT)) if tower else T.DacModel(T.DacConfig(**DAC))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.slow
def test_a_sub_model_never_called_runs_on_its_own_inputs():
    torch.manual_seed(0)
    m, x = randomized(WithCodec()).eval(), torch.randn(2, 4, dtype=torch.float64)
    unread = [f"codec.{n}" for n, _ in m.codec.named_parameters()]
    (want,) = entry_points(m, (x,), {}, unread)
    assert (want.path, want.method, want.fill) == ("codec", "forward", (OWN + "input_values",))
    assert want.own[0][0] == "input_values" and want.own[0][1][:2] == (2, 1) and want.own[0][2]
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and rep.exported_program.graph_module.meta[HOLDERS] == [want]
    assert [(g.kind, g.size) for g in rep.group_of("codec.encoder.block.1.conv1.weight", 0)] == [("perm", 16)]
    assert [(g.kind, g.size) for g in rep.group_of("codec.decoder.block.0.res_unit1.conv1.weight", 0)] == [
        ("perm", 4)]  # the codec's own channels, encoder and decoder
    (hidden,) = rep.group_of("up.weight", 0)
    assert hidden.kind == "signed_perm" and hidden.size == 10  # tanh is odd
    assert rep.certify(m, (x,)) <= 1e-6
    other = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, plain = flatten_outputs(rep.exported_program.module()(other)), flatten_outputs(m(other))
    assert max(float((a - b).abs().max()) for a, b in zip(got, plain)) < 1e-12  # the plain forward
    assert recovered(m, rep, (x,)) < 1e-5


def test_a_sub_model_without_codes_does_not_run():
    """A tower whose results are all floating is not run on its own inputs: in ``generate`` it
    might read or feed the model's states, whose axes move; its parameters stay unread."""
    torch.manual_seed(0)
    m, x = randomized(WithCodec(tower=True)).eval(), torch.randn(2, 4, dtype=torch.float64)
    unread = [f"codec.{n}" for n, _ in m.codec.named_parameters()]
    assert entry_points(m, (x,), {}, unread) == []
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is not None and rep.group_of("up.weight", 0) == []


def test_own_inputs_are_the_same_on_every_run_and_vary():
    m = torch.nn.Linear(2, 2).double()
    a, b = own_value((2, 1, 50), True, m, "cpu"), own_value((2, 1, 50), True, m, "cpu")
    assert a.dtype == torch.float64 and torch.equal(a, b) and a.unique().numel() > 90
    assert torch.equal(own_value((2, 3), False, m, "cpu"), torch.zeros(2, 3, dtype=torch.long))

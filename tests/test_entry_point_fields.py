"""Issue 65, an entry point's argument taken from the forward's run
(:mod:`symgraph.passes.entry_points`): Nemotron 3.5 Transcribe's word-timestamp encoder and head
are read only by ``get_word_timestamp_logits(asr_last_hidden_state, input_features_mask)``,
whose first argument is a field of the audio tower's output in the forward. The method is run
on that field's traced value, so the states the encoder's hidden units compute reach the head:
the field's space one class with both heads that read it, certified, and a moved copy recovered by its weights. Without the field
the first argument would be the main input (token ids), which the method refuses: every
parameter stayed fixed."""
from __future__ import annotations

import torch

import symgraph
from symgraph.passes.entry_points import EntryPoint, entry_points
from symgraph.passes.holder_inputs import HOLDERS

from test_holder_inputs import recovered


class Output(dict):
    """A model output: its fields by key."""


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 12), torch.nn.Linear(12, 6)

    def forward(self, x):
        return Output(hidden=self.down(torch.tanh(self.up(x))), extra=x.sum(-1))


class Transcriber(torch.nn.Module):
    """The forward reads the encoder and its output head; ``timestamps`` reads a head of its own
    on the encoder's ``hidden`` field, under a mask the forward takes."""

    def __init__(self):
        super().__init__()
        self.encoder, self.out = Encoder(), torch.nn.Linear(6, 3)
        self.stamp = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))

    def forward(self, features, mask):
        return self.out(self.encoder(features)["hidden"]) * mask[..., None]

    def timestamps(self, hidden, mask):
        return self.stamp(hidden) * mask[..., None]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"features": torch.randn(2, 5, 4, generator=g), "mask": torch.ones(2, 5)}


def test_the_method_takes_the_forward_field_of_its_name():
    torch.manual_seed(0)
    m, kw = Transcriber().eval(), _inputs()
    unread = [n for n, _ in m.named_parameters() if n.startswith("stamp.")]
    assert entry_points(m, (), kw, unread) == [EntryPoint("", "timestamps", ("field:hidden", "mask"))]
    rep = symgraph.analyze(m, kw)
    assert rep.exported_program.graph_module.meta[HOLDERS] == [EntryPoint("", "timestamps", ("field:hidden", "mask"))]
    assert rep.unread is None
    (inner,) = rep.group_of("stamp.0.weight", 0)  # the method's own hidden units, free
    assert inner.kind in ("perm", "signed_perm") and inner.size == 10
    (enc,) = rep.group_of("encoder.up.weight", 0)  # fixed by the unread head before
    assert enc.size == 12
    (field,) = rep.group_of("encoder.down.weight", 0)  # the field's space: both heads read it
    assert field.kind == "gl" and {("out.weight", 1), ("stamp.0.weight", 1)} <= set(field.params)
    assert rep.certify(m, kw) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=3))
    with torch.no_grad():  # each copy's method on its own field: the method's claim too
        got, want = (x.timestamps(x.encoder(kw["features"])["hidden"], kw["mask"]) for x in (moved, m))
        assert float((got - want).abs().max()) < 1e-5
    with torch.no_grad():  # the program computes the plain forward
        got = rep.exported_program.module()(**kw)
        assert float((got - m(**kw)).abs().max()) < 1e-12
    assert recovered(m, rep, kw) < 1e-5


class WithSpare(Transcriber):
    """A vector that only a private method reads: no trial reads it, and it is not dead."""

    def __init__(self):
        super().__init__()
        self.spare = torch.nn.Parameter(torch.ones(6))

    def _scale(self, h):
        return h * self.spare


def test_no_method_is_kept_where_a_parameter_stays_unread():
    """``spare`` fixes every class whatever ``timestamps`` reads: no entry is kept (its trace
    would cost time for nothing), and the report names ``spare``."""
    torch.manual_seed(0)
    m, kw = WithSpare().eval(), _inputs()
    unread = [n for n, _ in m.named_parameters() if n.startswith("stamp.")]
    assert entry_points(m, (), kw, unread) == [EntryPoint("", "timestamps", ("field:hidden", "mask"))]
    assert entry_points(m, (), kw, [*unread, "spare"]) == []
    rep = symgraph.analyze(m, kw)
    assert rep.exported_program.graph_module.meta[HOLDERS] == []
    assert rep.groups == [] and rep.unread.startswith("spare ")


class TwoMethods(Transcriber):
    """``states`` reads the first layer of the head; ``timestamps`` calls it and reads the rest
    (Nemotron 3.5 Transcribe's word-timestamp states and logits)."""

    def states(self, hidden):
        return torch.tanh(self.stamp[0](hidden))

    def timestamps(self, hidden, mask):
        return self.stamp[2](self.states(hidden)) * mask[..., None]


def test_a_method_another_kept_one_calls_is_dropped():
    torch.manual_seed(0)
    m, kw = TwoMethods().eval(), _inputs()
    unread = [n for n, _ in m.named_parameters() if n.startswith("stamp.")]
    assert entry_points(m, (), kw, unread) == [EntryPoint("", "timestamps", ("field:hidden", "mask"))]

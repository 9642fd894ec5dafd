"""Issue 65, other entry points (:mod:`symgraph.passes.entry_points`): ESM's contact head, which the
forward never reads, is read by ``predict_contacts(tokens, attention_mask)``, found by trial runs
(on a twin on ``meta``) that observe the parameters read; it runs the model under eager attention
for its attention maps. The program runs it beside the forward, adding ``0 *`` a weighted sum of
its result: it computes the plain forward on any batch, and every parameter is read. The heads of
each layer then move the regression's columns with them: certified in float64, the contacts of a
transformed copy are the model's, and a moved copy is recovered by weight matching."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.entry_points import EntryPoint, entry_points, own_methods
from symgraph.passes.holder_inputs import HOLDERS
from symgraph.passes.trace import flatten_outputs
from symgraph.testing.models import randomized

from test_holder_inputs import recovered

T = pytest.importorskip("transformers")

ESM = dict(vocab_size=33, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
           max_position_embeddings=40, pad_token_id=1, mask_token_id=32, position_embedding_type="absolute")


def _contacts(m, ids):
    m.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return m.esm.predict_contacts(ids, torch.ones_like(ids))
    finally:
        m.set_attn_implementation("sdpa")


@pytest.mark.parametrize("cls", ["EsmForMaskedLM", "EsmForSequenceClassification"])
@pytest.mark.slow
def test_esm_contact_head_is_read_by_predict_contacts(cls):
    m = randomized(getattr(T, cls)(T.EsmConfig(**ESM, num_labels=3)))
    rep = symgraph.analyze(m)
    assert rep.exported_program.graph_module.meta[HOLDERS] == [
        EntryPoint("esm", "predict_contacts", ("main", "ones"), eager=True)]
    assert rep.unread is None and m.config._attn_implementation == "sdpa"  # restored
    (cols,) = rep.group_of("esm.contact_head.regression.weight", 1)  # layers x heads columns
    assert cols.kind == "perm" and cols.size == 4
    assert cols in rep.group_of("esm.encoder.layer.0.attention.self.query.weight", 0)  # the heads
    mlp = rep.group_of("esm.encoder.layer.0.intermediate.dense.weight", 0)
    assert [g.kind for g in mlp] == ["perm"] and mlp[0].size == 24  # blocked before: unread fixed all
    assert rep.certify(m) <= 1e-6
    ids = rep.inputs[1]["input_ids"]
    B = symgraph.transform(m, rep.random_transform(seed=1))
    assert float((_contacts(m, ids) - _contacts(B, ids)).abs().max()) < 1e-12  # the method's claim too
    other = torch.randint(4, 30, ids.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = flatten_outputs(rep.exported_program.module()(input_ids=other))
        want = flatten_outputs(m.eval()(input_ids=other))
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-12  # the plain forward
    assert recovered(m, rep, rep.inputs[1]) < 1e-5


class WithSetter(torch.nn.Module):
    """A head the forward never reads, read by ``score``; ``set_head`` replaces it (a setter
    that takes a required argument, so a candidate tried first)."""

    def __init__(self):
        super().__init__()
        self.lin, self.out, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))

    def set_head(self, value):
        self.head = torch.nn.Identity()

    def score(self, x):
        return self.head(torch.relu(self.lin(x)))


def test_a_method_that_changes_the_model_is_tried_on_a_twin_only():
    torch.manual_seed(0)
    m, x = WithSetter().eval(), torch.randn(3, 4)
    head = m.head
    assert entry_points(m, (x,), {}, ["head.weight", "head.bias"]) == [EntryPoint("", "score", ("main",))]
    assert m.head is head and isinstance(m.head, torch.nn.Linear)  # set_head ran on a twin
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None
    (hidden,) = rep.group_of("head.weight", 1)  # the ReLU's units, read by the head
    assert hidden.kind == "scaled_perm" and rep.group_of("lin.weight", 0) == [hidden]
    assert rep.certify(m, (x,)) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=2))
    with torch.no_grad():
        assert float((moved.score(x) - m.score(x)).abs().max()) < 1e-5  # the method's claim too


def test_torch_containers_offer_no_methods():
    """A list of layers above an unread parameter is torch's own: its ``append``, ``insert``
    and ``pop`` are no entry points (they would spend the trials)."""
    assert own_methods(torch.nn.ModuleList([torch.nn.Linear(2, 2)])) == [] == own_methods(torch.nn.Linear(2, 2))
    assert [n for n, _ in own_methods(WithSetter())] == ["set_head", "score"]


@pytest.mark.slow
def test_esm_on_meta_is_traced_through_the_same_method_and_classes():
    torch.manual_seed(0)
    real = T.EsmForMaskedLM(T.EsmConfig(**ESM)).eval()
    with torch.device("meta"):
        m = T.EsmForMaskedLM(T.EsmConfig(**ESM)).eval()
    ids = torch.randint(4, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    rep, on_meta = symgraph.analyze(real, {"input_ids": ids}), symgraph.analyze(m, {"input_ids": ids})
    assert on_meta.unread is None
    assert on_meta.exported_program.graph_module.meta[HOLDERS] == rep.exported_program.graph_module.meta[HOLDERS]
    assert [(g.kind, g.size, g.params) for g in on_meta.groups] == [(g.kind, g.size, g.params) for g in rep.groups]
    assert len(rep.groups) == 8


class Overflowing(WithSetter):
    """``score`` overflows (``exp``) on a batch of large values where the forward does not."""

    def score(self, x):
        return torch.exp(self.head(torch.relu(self.lin(x))))


def test_an_extra_run_that_overflows_leaves_the_forward_exact():
    """The program adds ``0 * s`` of the method's result: ``s`` infinite would make every
    output NaN on that batch (statistics, REPAIR's runs); it counts as zero instead."""
    torch.manual_seed(0)
    m, x = Overflowing().eval(), torch.randn(3, 4)
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and rep.certify(m, (x,)) <= 1e-6
    big = 1e4 * torch.ones(3, 4)
    with torch.no_grad():
        assert not torch.isfinite(m.score(big)).all()
        got, want = rep.exported_program.module()(big), m(big)
    assert torch.isfinite(got).all() and torch.equal(got, want)

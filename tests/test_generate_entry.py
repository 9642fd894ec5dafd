"""Issue 65, parameters that only ``generate`` reads (Pop2Piano's composer embedding, which
``generate`` concatenates to the mel features before the encoder runs): the forward never reads
them, so ``analyze(model)`` fixes every class and says which parameter to reach. The route is
the user's: a module whose forward calls ``generate``, analysed like any model. ``generate``
deep-copies its generation config, which holds its pad token as a tensor of the program; the
trace copies such a value in the program (``torch.export`` cannot read its storage)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import symgraph
from function_helpers import assert_recovered

T = pytest.importorskip("transformers")


class DeepCopies(torch.nn.Module):
    """A forward that deep-copies a holder of a tensor it made, and a hidden state: 4 -> 8 -> 4
    (ReLU units: permuted and positively scaled)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        holder = copy.deepcopy(SimpleNamespace(scale=torch.tensor(2.0)))
        h = torch.relu(self.a(x)) * holder.scale
        return self.b(copy.deepcopy(h))


def _recovered(A, rep, inputs):
    """A copy of ``A`` moved by a random element of the orthogonal part of ``rep``'s classes
    (checked moved) is aligned back by weights to every tensor of ``A`` within 1e-6."""
    B = symgraph.transform(A, rep.random_transform(seed=1, orthogonal=True))
    assert max((B.state_dict()[k] - v).abs().max().item() for k, v in A.state_dict().items()) > 1e-2
    assert_recovered(A, B, inputs, atol=1e-6)


def test_a_forward_that_deep_copies_a_value_it_computes_is_traced():
    torch.manual_seed(0)
    m, x = DeepCopies().eval(), torch.randn(3, 4)
    rep = symgraph.analyze(m, (x,))
    hidden = [g for g in rep.groups if ("a.weight", 0) in [tuple(p) for p in g.params]]
    assert len(hidden) == 1 and hidden[0].kind == "scaled_perm" and hidden[0].size == 8
    assert ("b.weight", 1) in [tuple(p) for p in hidden[0].params]
    assert rep.certify(m, (x,)) <= 1e-12
    _recovered(m, rep, (x,))


class OneStep(torch.nn.Module):
    """Pop2Piano's one greedy step of ``generate`` from mel features: its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_features):
        out = self.model.generate(input_features=input_features, composer="composer2", max_new_tokens=1,
                                  do_sample=False, return_dict_in_generate=True, output_logits=True)
        return out.logits[0]


@pytest.fixture(scope="module")
def pop2piano():
    cfg = T.Pop2PianoConfig(vocab_size=64, composer_vocab_size=3, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                            num_decoder_layers=2, num_heads=4)
    torch.manual_seed(0)
    m = T.Pop2PianoForConditionalGeneration(cfg).eval()
    # as a released checkpoint's generation config states them: the composers' tokens, the decoder's start
    m.generation_config = T.GenerationConfig(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                             composer_to_feature_token={f"composer{i + 1}": 21 + i for i in range(3)})
    return m


def test_pop2piano_forward_alone_fixes_every_class_and_names_the_parameter(pop2piano):
    rep = symgraph.analyze(pop2piano)
    assert rep.groups == [] and "mel_conditioner.embedding.weight" in rep.unread


def test_pop2piano_through_its_generate_claims_heads_and_units_certified_and_recovered(pop2piano):
    """Through one step of ``generate`` every parameter is read, the composer embedding
    included; the encoder's residual stream meets the features the user gives, so it stays
    fixed, while every attention's heads and every feed-forward's units are classes."""
    wrapped, x = OneStep(pop2piano), (torch.randn(2, 7, 32),)
    rep = symgraph.analyze(wrapped, x)
    assert rep.unread is None
    held = {p for g in rep.groups for p, _ in g.params}
    for i in range(2):
        assert f"model.encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight" in held
        assert f"model.decoder.block.{i}.layer.1.EncDecAttention.q.weight" in held
    assert len(rep.attention_groups()) == 6  # encoder self, decoder self and cross, two layers each
    assert rep.certify(wrapped, x) <= 1e-6
    _recovered(wrapped, rep, x)

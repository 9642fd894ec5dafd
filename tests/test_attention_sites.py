"""Attention written out (``matmul(softmax(f(q kᵀ)), v)``, Hugging Face's eager attention) is an
attention site of the report like ``scaled_dot_product_attention``, whatever elementwise ``f``
sits on the scores: Gemma 2's softcapping ``tanh(s / c) · c`` included. Its heads' classes are
found (mapping), their random elements keep the function (certificate), a scrambled copy is
recovered by weights, and ``symgraph rotate`` rotates their value-output maps."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.testing import models

from function_helpers import logits as _logits, rel

transformers = pytest.importorskip("transformers")
V = 64
X = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))


def gemma2(softcap=0.5):
    """Tiny Gemma 2, its scores large enough for the softcap ``tanh(s / c) · c`` to bend them."""
    cfg = transformers.Gemma2Config(vocab_size=V, use_cache=False, num_key_value_heads=2, head_dim=8,
                                    hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=48, max_position_embeddings=32,
                                    attn_logit_softcapping=softcap)
    torch.manual_seed(0)
    m = models.randomize_vectors(transformers.Gemma2ForCausalLM(cfg).eval(), seed=1)
    with torch.no_grad():  # scores of order one (the init's are ~1e-3: tanh would be linear on them)
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight *= 40
    return m


def logits(m, x=X):
    return _logits(m, x)


def rel_params(a, b):
    num = sum(float((p.double() - q.double()).pow(2).sum()) for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum(float(p.double().pow(2).sum()) for p in a.parameters())) ** 0.5


@pytest.fixture(scope="module")
def gemma():
    m = gemma2()
    return m, symgraph.analyze(m)


def test_gemma2_softcap_is_on_and_changes_the_function():
    assert rel(logits(gemma2()), logits(gemma2(softcap=None))) > 1e-3  # tanh really bends the scores


def test_gemma2_softcapped_heads_mapping(gemma):
    m, report = gemma
    groups = {g.id: g for g in report.groups}
    sites = report.attention_groups()
    assert len(sites) == 2
    for layer, s in enumerate(sites):
        qk, vo = groups[s["qk"]], groups[s["vo"]]
        pre = f"model.layers.{layer}.self_attn."
        assert qk.kind == "rope" and {p for p, _ in qk.params} == {pre + "q_proj.weight", pre + "k_proj.weight"}
        assert vo.kind in ("gl", "orthogonal") and vo.dim == 8
        assert {p for p, _ in vo.params} == {pre + "v_proj.weight", pre + "o_proj.weight"}
        outer = [groups[i] for i in vo.outer]
        assert [g.kind for g in outer] == ["perm"] and outer[0].dim == 2  # the KV heads
        assert {p for p, _ in outer[0].params} >= {pre + n + "_proj.weight" for n in "qkvo"}
        assert vo.blocks == 2 and qk.blocks == 2  # one inner element per KV head (shared by its query heads)


def test_gemma2_softcapped_heads_certify_and_rotate(gemma):
    m, report = gemma
    assert report.certify(m) <= 1e-6
    res = symgraph.rotate(m, how="hadamard", seed=0)
    vo = [s["vo"] for s in res.report.attention_groups()]
    assert res.roles["vo"] == vo and len(vo) == 2
    assert res.error <= 1e-5 and rel(logits(m), logits(res.model)) <= 1e-5
    v = "model.layers.0.self_attn.v_proj.weight"
    assert not torch.allclose(res.model.get_parameter(v), m.get_parameter(v))  # the heads really rotated


def test_gemma2_softcapped_heads_recovered_by_weights(gemma):
    A, report = gemma
    B = symgraph.transform(A, report.random_transform(seed=1, orthogonal=True))
    assert rel_params(A, B) > 0.1
    before = copy.deepcopy(B.state_dict())
    C = symgraph.align(A, B).apply(B)
    assert rel_params(A, C) < 1e-6
    assert all(torch.equal(v, before[k]) for k, v in B.state_dict().items())


def test_eager_and_sdpa_attention_give_the_same_sites():
    eager = models.build("llama", seed=0, attn_implementation="eager")
    sdpa = models.build("llama", seed=0)
    got = []
    for m in (eager, sdpa):
        r = symgraph.analyze(m)
        groups = {g.id: g for g in r.groups}
        got.append([(groups[s["qk"]].kind, sorted(groups[s["qk"]].params), groups[s["vo"]].kind,
                     sorted(groups[s["vo"]].params)) for s in r.attention_groups()])
    assert got[0] == got[1] and len(got[0]) == 2


class Softcapped(torch.nn.Module):
    """Attention written by hand, softcapped, two heads of 4: no Hugging Face code."""

    def __init__(self, d=8, heads=2, cap=5.0):
        super().__init__()
        self.heads, self.cap = heads, cap
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = torch.tanh(q @ k.transpose(-1, -2) / self.cap) * self.cap
        z = torch.softmax(s, dim=-1) @ v
        return self.o(z.transpose(1, 2).reshape(b, t, d))


class NotAttention(torch.nn.Module):
    """A softmax over a product with a weight, times a weight: no per-head scores."""

    def __init__(self, d=8):
        super().__init__()
        self.w, self.u = torch.nn.Parameter(torch.randn(d, d)), torch.nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        return torch.softmax(x @ self.w, dim=-1) @ self.u


def test_hand_written_softcapped_attention_is_a_site():
    torch.manual_seed(0)
    m = Softcapped().eval()
    x = torch.randn(2, 5, 8)
    r = symgraph.analyze(m, (x,))
    (site,) = r.attention_groups()
    vo = next(g for g in r.groups if g.id == site["vo"])
    assert {p for p, _ in vo.params} == {"v.weight", "v.bias", "o.weight"} and vo.blocks == 2
    assert r.certify(m, (x,)) <= 1e-6
    assert symgraph.analyze(NotAttention(), (x,)).attention_groups() == []

"""Differential attention and the traced families that could not be certified (issue 46).

DiffLlama computes ``(softmax(Q1 K1ᵀ) - λ softmax(Q2 K2ᵀ)) V`` as two attention calls: the
value heads are cut in halves, each half ``repeat``-ed to every key/value head, and the
outputs' heads cut in halves again, the halves subtracted (``o1 - λ o2``). The query head
axis is then a concatenation of two copies of one class (the head *pairs*: heads ``k`` and
``k + H/2``), so the head dimensions fibred over the pairs are fibred over a class inside a
concatenation, not over an outer factor: their element on a projection is read per copy.
``repeat`` is a concatenation of copies (:func:`symgraph.passes.rules.views.repeat`).

Beam gates each attention head's output by ``sigmoid(gate_proj(x).view_as(attn_output))``:
``view_as`` is a reshape to the other tensor's shape (it was read as elementwise and crashed).

ERNIE 4.5 MoE stores a routing bias ``[1, E]``: a class of one coordinate is no fibre (it was
viewed as a product with the experts, which re-rooted the expert class under the fibres).

Each: certified in float64, the groups it must have, and a transformed copy recovered exactly
by weight matching."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.report.symmetry import Transform
from test_families_full_groups import _rel
from symgraph.testing.models import randomized as shared_randomized

transformers = pytest.importorskip("transformers")

V, D, HD = 64, 16, 4
CERT = 1e-9
ATTN = "model.layers.0.self_attn"


def ids():
    return {"input_ids": torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))}



def randomized(model, seed=0):
    """HF initialises norms to ones and some weights to zero: every parameter drawn, float32."""
    return shared_randomized(model, seed, dtype=torch.float32)


def diffllama(kv=4, cls="DiffLlamaForCausalLM"):
    cfg = transformers.DiffLlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, head_dim=HD, max_position_embeddings=32, use_cache=False, pad_token_id=0)
    return randomized(getattr(transformers, cls)(cfg))


def ernie():
    cfg = transformers.Ernie4_5_MoeConfig(
        vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=6, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
        moe_layer_start_index=1, max_position_embeddings=32, use_cache=False)
    return randomized(transformers.Ernie4_5_MoeForCausalLM(cfg))


def recovered(A, rep):
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    al = symgraph.align(A, B, report_a=rep, full_groups=True)
    return _rel(A, al.apply(B))


def kind_of(report, param, dim, kind):
    (g,) = [g for g in report.group_of(param, dim) if g.kind == kind]
    return g


# --- repeat: a concatenation of copies ------------------------------------------------------

class Repeats(nn.Module):
    """A hidden class read twice side by side, 70 times (a product with a fixed factor), and
    along a new leading axis (a broadcast)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 6), nn.Linear(12, 8), nn.Linear(420, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h.repeat(1, 1, 2)) + self.c(h.repeat(1, 1, 70))
        return y.repeat(3, 1, 1, 1).mean(0)


def test_repeat_is_a_concatenation_of_copies():
    torch.manual_seed(0)
    m = Repeats().double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < CERT
    (hidden,) = r.group_of("a.weight", 0)  # relu: positive scalings too
    assert (hidden.kind, hidden.dim, hidden.blocks) == ("scaled_perm", 6, 1)
    assert r.group_of("b.weight", 1) == [hidden] == r.group_of("c.weight", 1)
    assert r.axis_structure(r.param_axes("b.weight")[1]) == ("sum", [6, 6])
    assert r.axis_structure(r.param_axes("c.weight")[1]) == ("prod", [70, 6])
    P = torch.eye(6, dtype=torch.float64)[[1, 0, 3, 2, 5, 4]]
    new = symgraph.transform(m, Transform(r, {hidden.id: P})).state_dict()
    old = m.state_dict()
    torch.testing.assert_close(new["b.weight"], old["b.weight"] @ torch.block_diag(P, P).T, rtol=0, atol=0)
    assert symgraph.transform(m, r.random_transform(seed=1)) is not None


# --- DiffLlama ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def diff():
    model = diffllama().double()
    return model, symgraph.analyze(model)


def test_diffllama_groups_and_certificate(diff):
    model, r = diff
    assert r.frozen == [] and r.certify(model, ids()) < CERT
    pairs = kind_of(r, f"{ATTN}.o_proj.weight", 1, "perm")
    assert (pairs.dim, pairs.blocks, pairs.outer) == (2, 1, [])  # heads k and k + 2
    assert {(f"{ATTN}.{p}_proj.weight", 0) for p in "qkv"} | {(f"{ATTN}.o_proj.weight", 1)} <= set(pairs.params)
    rope = kind_of(r, f"{ATTN}.q_proj.weight", 0, "rope")
    assert (rope.dim, rope.blocks, rope.outer) == (HD, 2, [pairs.id])
    assert r.group_of(f"{ATTN}.k_proj.weight", 0) == r.group_of(f"{ATTN}.q_proj.weight", 0)
    # the value heads' two halves (``chunk(v, 2, dim=1)``) each their own orthogonal class (the
    # norm without gains after them acts on both halves' dimensions, so a block-diagonal map
    # commutes with it); one class served both before ``chunk`` was read as a packed split
    vo = [g for g in r.group_of(f"{ATTN}.v_proj.weight", 0) if g.kind == "orthogonal"]
    assert [(g.dim, g.blocks, g.outer) for g in vo] == 2 * [(HD, 2, [pairs.id])]
    assert all((f"{ATTN}.o_proj.weight", 1) in g.params for g in vo) and vo[0].id != vo[1].id
    for a, b in (("q1", "k1"), ("q2", "k2")):  # Σ λ_q λ_k: one order of the two vectors' entries
        (lam,) = r.group_of(f"{ATTN}.lambda_{a}", 0)
        assert (lam.kind, lam.dim) == ("perm", HD) and r.group_of(f"{ATTN}.lambda_{b}", 0) == [lam]
    stream = kind_of(r, "model.embed_tokens.weight", 1, "orthogonal")
    assert (stream.dim, stream.blocks) == (D, 1)
    assert sorted((g.kind, g.dim, g.blocks) for g in r.groups) == sorted(
        [("orthogonal", D, 1)] + 2 * [("perm", 2, 1), ("rope", HD, 2), ("orthogonal", HD, 2), ("orthogonal", HD, 2),
                                      ("perm", HD, 1), ("perm", HD, 1), ("perm", 24, 1)])


def test_diffllama_head_pairs_move_both_halves(diff):
    model, r = diff
    pairs = kind_of(r, f"{ATTN}.o_proj.weight", 1, "perm")
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    new = symgraph.transform(model, Transform(r, {pairs.id: swap})).state_dict()
    old = model.state_dict()
    heads = [1, 0, 3, 2]  # query, key and value heads k and k + 2 are pair k
    for p in "qkv":
        w = old[f"{ATTN}.{p}_proj.weight"].view(4, HD, D)[heads].reshape(4 * HD, D)
        torch.testing.assert_close(new[f"{ATTN}.{p}_proj.weight"], w, rtol=0, atol=0)
    o = old[f"{ATTN}.o_proj.weight"].view(D, 2, 2 * HD)[:, [1, 0]].reshape(D, 4 * HD)
    torch.testing.assert_close(new[f"{ATTN}.o_proj.weight"], o, rtol=0, atol=0)
    moved = {f"{ATTN}.{p}_proj.weight" for p in "qkvo"}
    assert [k for k in old if k not in moved and not torch.equal(new[k], old[k])] == []


def test_diffllama_rotations_are_read_per_copy_of_the_pairs(diff):
    """The rope class is fibred over the pairs, a class inside the concatenation of the query
    head axis: head ``h`` takes the rotation of pair ``h mod 2``."""
    model, r = diff
    rope = kind_of(r, f"{ATTN}.q_proj.weight", 0, "rope")
    el = r.random_transform(seed=2).elements[rope.id]
    assert el.shape == (2, HD, HD)
    new = symgraph.transform(model, Transform(r, {rope.id: el})).state_dict()
    old = model.state_dict()
    for p in "qk":
        w, got = old[f"{ATTN}.{p}_proj.weight"].view(4, HD, D), new[f"{ATTN}.{p}_proj.weight"].view(4, HD, D)
        for h in range(4):
            torch.testing.assert_close(got[h], el[h % 2] @ w[h])


def test_diffllama_recovered_by_weights():
    A = diffllama()
    rep = symgraph.analyze(A)
    assert recovered(A, rep) < 1e-6


@pytest.mark.slow  # the MHA causal LM runs by default (groups, certificate, recovery)
@pytest.mark.parametrize("kv, cls", [(2, "DiffLlamaForCausalLM"), (4, "DiffLlamaForSequenceClassification")])
def test_diffllama_grouped_kv_and_classifier_certified_and_recovered(kv, cls):
    A = diffllama(kv, cls)
    rep = symgraph.analyze(A)
    assert rep.frozen == [] and rep.certify(A, tol=1e-6) < 1e-6
    assert [g.kind for g in rep.groups if g.module == ATTN].count("rope") == 1
    assert recovered(A, rep) < 1e-6


# --- ERNIE 4.5 MoE ----------------------------------------------------------------------------

def test_ernie4_5_moe_certified_and_recovered():
    A = ernie()
    rep = symgraph.analyze(A)
    assert rep.frozen == [] and rep.certify(A.double()) < CERT
    A.float()
    mlp = "model.layers.1.mlp"
    experts = kind_of(rep, f"{mlp}.gate.weight", 0, "perm")
    assert experts.dim == 4
    bias = f"{mlp}.gate.moe_statics.e_score_correction_bias"  # [1, E]: one row, no fibre
    assert bias not in rep.stacked and rep.group_of(bias, 1) == [experts]
    hidden = kind_of(rep, f"{mlp}.experts.down_proj", 2, "perm")  # down_proj [E, d, I]
    assert (hidden.dim, hidden.blocks, hidden.outer) == (6, 4, [experts.id])
    assert rep.stacked[f"{mlp}.experts.down_proj"] == (0, 2)
    assert (kind_of(rep, f"{mlp}.shared_experts.down_proj.weight", 1, "perm").dim) == 6
    assert recovered(A, rep) < 1e-6


# --- Beam: a per-head output gate through view_as ---------------------------------------------

def beam():
    """Dense MLPs only: the experts' ``repeat_interleave`` (no rule) has the graph re-traced
    through core ATen decompositions, which write ``view_as`` as ``view``."""
    cfg = transformers.BeamConfig(
        vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HD, max_position_embeddings=32, use_cache=False,
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "dense"])
    return randomized(transformers.BeamForCausalLM(cfg))


def test_beam_gated_heads_certified_and_recovered():
    A = beam()
    rep = symgraph.analyze(A)
    assert rep.frozen == [] and rep.certify(A.double()) < CERT
    A.float()
    for layer in (0, 1):
        attn = f"model.layers.{layer}.self_attn"
        (kv,) = [g for g in rep.group_of(f"{attn}.k_proj.weight", 0) if g.dim == 2]  # kv heads
        assert (kv.kind, kv.outer) == ("perm", []) and {(f"{attn}.gate_proj.weight", 0), (f"{attn}.gate_bias", 0),
                                (f"{attn}.o_proj.weight", 1)} <= set(kv.params)
        assert rep.axis_structure(rep.param_axes(f"{attn}.gate_proj.weight")[0])[0] == "prod"
        assert rep.group_of(f"{attn}.gate_proj.weight", 0) == rep.group_of(f"{attn}.o_proj.weight", 1)
    assert recovered(A, rep) < 1e-6

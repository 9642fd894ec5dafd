"""Layouts of the newest decoders (issue 46, part 1): experts whose fused gate/up projection
holds gate and up in alternating columns (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``,
GPT-OSS) with a clamped GLU; DeepSeek's group-limited routing (a ``scatter`` of the top groups,
a ``gather`` of the routing weights); attention sinks (a per-head logit concatenated before the
softmax); multi-head latent attention (keys written into ``new_empty`` by slices: the per-head
nope part and the rope part shared by every head).

Each layout: (a) the exact mapping, by applying a known element of one class and reading which
entries moved; (b) a random transform certified and recovered by alignment."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.report.symmetry import Transform
from symgraph.solve import nested_tree
from test_families_full_groups import _batches, _rel
from symgraph.testing.models import randomized as shared_randomized

V, D, I, E = 64, 16, 12, 4


def ids():
    return {"input_ids": torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))}



def randomized(model, seed=0):
    """HF initialises norms to ones and some weights to zero: every parameter drawn, float32."""
    return shared_randomized(model, seed, dtype=torch.float32)


def gpt_oss():
    return tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_local_experts=E, num_experts_per_tok=2,
        max_position_embeddings=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))


def deepseek_v2():
    return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        vocab_size=V, hidden_size=D, intermediate_size=24, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, max_position_embeddings=32))


def deepseek_v3(q_lora_rank=8):
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        vocab_size=V, hidden_size=D, intermediate_size=24, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=6, n_group=2, topk_group=1, max_position_embeddings=32))


def only(report, param, dim):
    (g,) = report.group_of(param, dim)
    return g


def moved_by(report, model, group, element):
    """Every tensor of ``model`` after applying ``element`` to ``group`` alone (the identity
    elsewhere), and the model's own: ``(new, old)`` state dicts."""
    new = symgraph.transform(model, Transform(report, {group.id: element.double()}))
    return new.state_dict(), model.state_dict()


def unchanged_but(new, old, names):
    return [k for k in old if k not in names and not torch.equal(new[k], old[k])]


def perm_matrix(index):
    return torch.eye(len(index), dtype=torch.float64)[torch.as_tensor(index)]


SIGMA = [2, 0, 3, 1, 5, 4, 7, 6, 9, 8, 11, 10]  # a permutation of I = 12 hidden units


# --- alternating columns and a clamped GLU -------------------------------------------------

class AlternatingGLU(torch.nn.Module):
    """GPT-OSS's gate: ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]``, both clamped, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Linear(D, 2 * I)
        self.down = torch.nn.Linear(I, D)

    def forward(self, x):
        h = self.gate_up(x)
        gate, up = h[..., ::2].clamp(max=0.7), h[..., 1::2].clamp(-0.7, 0.7)
        return self.down((up + 1) * gate * torch.sigmoid(1.702 * gate))


def test_alternating_columns_are_one_hidden_class_in_pairs():
    torch.manual_seed(0)
    m = AlternatingGLU().double().eval()
    x = torch.randn(3, 5, D, dtype=torch.float64)
    r = symgraph.analyze(m, (x,))
    assert r.frozen == [] and r.certify(m, (x,)) < 1e-6
    hidden = only(r, "down.weight", 1)
    assert (hidden.kind, hidden.size, hidden.blocks) == ("perm", I, 1)
    assert {("gate_up.weight", 0), ("gate_up.bias", 0), ("down.weight", 1)} <= set(hidden.params)
    # the 2I axis is (hidden unit, gate or up): entry 2i + s is unit i's gate (s=0) or up (s=1)
    assert r.axis_structure(r.param_axes("gate_up.weight")[0]) == ("prod", [I, 2])
    P = perm_matrix(SIGMA)
    new, old = moved_by(r, m, hidden, P)
    for s in (0, 1):  # the ::2 and the 1::2 rows move by one permutation
        torch.testing.assert_close(new["gate_up.weight"][s::2], P @ old["gate_up.weight"][s::2], rtol=0, atol=0)
        torch.testing.assert_close(new["gate_up.bias"][s::2], P @ old["gate_up.bias"][s::2], rtol=0, atol=0)
    torch.testing.assert_close(new["down.weight"], old["down.weight"] @ P.T, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(symgraph.transform(m, Transform(r, {hidden.id: P}))(x), m(x))


def test_alternating_columns_recovered_by_weights_and_activations():
    torch.manual_seed(0)
    A = AlternatingGLU().eval()
    x = torch.randn(4, 6, D)
    rep = symgraph.analyze(A, (x,))
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    for data in (None, [(torch.randn(8, 6, D, generator=torch.Generator().manual_seed(i)),) for i in range(3)]):
        al = symgraph.align(A, B, (x,), data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"


# --- GPT-OSS: fused experts in alternating columns, clamped GLU, sinks ---------------------

@pytest.fixture(scope="module")
def oss():
    model = randomized(gpt_oss()).double()
    return model, symgraph.analyze(model, ids())


def test_gpt_oss_each_expert_has_its_own_hidden_units_in_alternating_columns(oss):
    model, r = oss
    assert r.frozen == [] and r.certify(model, ids()) < 1e-6
    mlp = "model.layers.0.mlp.experts"
    experts = only(r, "model.layers.0.mlp.router.weight", 0)
    assert (experts.kind, experts.size) == ("perm", E)
    hidden = only(r, f"{mlp}.down_proj", 1)  # down_proj [E, I, d]; gate_up_proj [E, d, 2I]
    assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", I, E, [experts.id])
    assert r.group_of(f"{mlp}.gate_up_proj", 2) == [hidden] == r.group_of(f"{mlp}.gate_up_proj_bias", 1)
    assert r.stacked[f"{mlp}.gate_up_proj"] == (0, 2) and r.stacked[f"{mlp}.down_proj"] == (0, 1)
    # expert 1 alone takes SIGMA: its ::2 (gate) and 1::2 (up) columns move by it, its down
    # rows too; no other expert and no other tensor moves
    P = perm_matrix(SIGMA)
    el = torch.eye(I, dtype=torch.float64).repeat(E, 1, 1)
    el[1] = P
    new, old = moved_by(r, model, hidden, el)
    names = {f"{mlp}.gate_up_proj", f"{mlp}.gate_up_proj_bias", f"{mlp}.down_proj"}
    assert unchanged_but(new, old, names) == []
    for e in range(E):
        Q = P if e == 1 else torch.eye(I, dtype=torch.float64)
        for s in (0, 1):
            torch.testing.assert_close(new[f"{mlp}.gate_up_proj"][e][:, s::2], old[f"{mlp}.gate_up_proj"][e][:, s::2] @ Q.T)
            torch.testing.assert_close(new[f"{mlp}.gate_up_proj_bias"][e][s::2], Q @ old[f"{mlp}.gate_up_proj_bias"][e][s::2])
        torch.testing.assert_close(new[f"{mlp}.down_proj"][e], Q @ old[f"{mlp}.down_proj"][e])


def test_gpt_oss_sinks_move_with_their_query_heads(oss):
    model, r = oss
    attn = "model.layers.0.self_attn"
    kv, rope = r.group_of(f"{attn}.k_proj.weight", 0)  # key/value groups, then the rotary pairs in a head
    assert (kv.kind, rope.kind, rope.pairs, rope.outer) == ("perm", "rope", ((0, 2), (1, 3)), [kv.id])
    heads = next(g for g in r.group_of(f"{attn}.sinks", 0) if g.outer)  # query heads within a group
    assert r.group_of(f"{attn}.sinks", 0) == [kv, heads]  # sinks [H] = (key/value group, head in it)
    assert (heads.kind, heads.dim, heads.blocks, heads.outer) == ("perm", 2, 2, [kv.id])
    assert {(f"{attn}.q_proj.weight", 0), (f"{attn}.o_proj.weight", 1)} <= set(heads.params)
    el = torch.eye(2, dtype=torch.float64).repeat(2, 1, 1)
    el[0] = perm_matrix([1, 0])  # swap query heads 0 and 1 (group 0); group 1 stays
    new, old = moved_by(r, model, heads, el)
    names = {f"{attn}.{p}" for p in ("sinks", "q_proj.weight", "q_proj.bias", "o_proj.weight")}
    assert unchanged_but(new, old, names) == []
    swap = [1, 0, 2, 3]
    torch.testing.assert_close(new[f"{attn}.sinks"], old[f"{attn}.sinks"][swap], rtol=0, atol=0)
    q = old[f"{attn}.q_proj.weight"].view(4, 4, D)[swap].reshape(16, D)
    torch.testing.assert_close(new[f"{attn}.q_proj.weight"], q, rtol=0, atol=0)
    o = old[f"{attn}.o_proj.weight"].view(D, 4, 4)[:, swap].reshape(D, 16)
    torch.testing.assert_close(new[f"{attn}.o_proj.weight"], o, rtol=0, atol=0)


@pytest.mark.slow
def test_gpt_oss_recovered_by_weights():
    A = randomized(gpt_oss())
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    al = symgraph.align(A, B, report_a=rep, full_groups=True)
    assert _rel(A, al.apply(B)) < 1e-6


@pytest.mark.slow
def test_gpt_oss_recovered_by_activations():
    A = randomized(gpt_oss())
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    al = symgraph.align(A, B, data=_batches(A), report_a=rep, full_groups=True)
    assert _rel(A, al.apply(B)) < 1e-6


# --- multi-head latent attention and stacked experts: DeepSeek-V2 ---------------------------

def test_latent_attention_heads_and_per_expert_hidden_units():
    model = randomized(deepseek_v2()).double()
    r = symgraph.analyze(model, ids())
    assert r.frozen == [] and r.certify(model, ids()) < 1e-6
    attn, H, nope, rope, v = "model.layers.0.self_attn", 4, 4, 4, 6
    heads = next(g for g in r.groups if g.kind == "perm" and (f"{attn}.kv_b_proj.weight", 0) in g.params)
    assert (heads.size, heads.blocks) == (H, 1)
    assert {(f"{attn}.q_proj.weight", 0), (f"{attn}.o_proj.weight", 1)} <= set(heads.params)
    assert not any(p == f"{attn}.kv_a_proj_with_mqa.weight" for p, _ in heads.params)  # latent, shared rope key
    # per head: a GL class on the nope part of Q and K, one on V and O's columns
    qk = next(g for g in r.groups if g.kind == "gl" and (f"{attn}.q_proj.weight", 0) in g.params)
    vo = next(g for g in r.groups if g.kind == "gl" and (f"{attn}.o_proj.weight", 1) in g.params)
    assert (qk.dim, qk.blocks, qk.outer) == (nope, H, [heads.id])
    assert (vo.dim, vo.blocks, vo.outer) == (v, H, [heads.id])
    sigma = [2, 0, 3, 1]
    new, old = moved_by(r, model, heads, perm_matrix(sigma))
    names = {f"{attn}.{p}" for p in ("q_proj.weight", "kv_b_proj.weight", "o_proj.weight")}
    assert unchanged_but(new, old, names) == []  # kv_a_proj_with_mqa (latent + shared rope key) stays
    torch.testing.assert_close(new[f"{attn}.q_proj.weight"],
                               old[f"{attn}.q_proj.weight"].view(H, nope + rope, D)[sigma].reshape(-1, D), rtol=0, atol=0)
    kvb = old[f"{attn}.kv_b_proj.weight"]
    torch.testing.assert_close(new[f"{attn}.kv_b_proj.weight"],
                               kvb.view(H, nope + v, -1)[sigma].reshape(kvb.shape), rtol=0, atol=0)
    torch.testing.assert_close(new[f"{attn}.o_proj.weight"],
                               old[f"{attn}.o_proj.weight"].view(D, H, v)[:, sigma].reshape(D, -1), rtol=0, atol=0)
    # the MoE layer: experts a permutation class, each expert's hidden units its own class
    mlp = "model.layers.1.mlp"
    experts = only(r, f"{mlp}.gate.weight", 0)
    hidden = only(r, f"{mlp}.experts.down_proj", 2)
    assert (experts.kind, experts.size) == ("perm", E)
    assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", I, E, [experts.id])
    shared = only(r, f"{mlp}.shared_experts.down_proj.weight", 1)
    assert (shared.kind, shared.blocks) == ("perm", 1)


@pytest.mark.slow
def test_latent_attention_recovered_by_weights_and_activations():
    A = randomized(deepseek_v2())
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"


# --- DeepSeek-V3: group-limited routing, latent attention with a low-rank query -------------

@pytest.fixture(scope="module")
def v3():
    model = randomized(deepseek_v3()).double()
    return model, symgraph.analyze(model, ids())


def test_group_limited_routing_groups_experts_and_hidden_units(v3):
    model, r = v3
    assert r.frozen == [] and r.certify(model, ids()) < 1e-6
    mlp = "model.layers.1.mlp"
    within = next(g for g in r.group_of(f"{mlp}.gate.weight", 0) if g.outer)  # experts in a group
    (groups,) = [g for g in r.group_of(f"{mlp}.gate.weight", 0) if not g.outer]
    assert (groups.kind, groups.size) == ("perm", 2)
    assert (within.kind, within.dim, within.blocks, within.outer) == ("perm", 2, 2, [groups.id])
    hidden = only(r, f"{mlp}.experts.down_proj", 2)
    assert (hidden.kind, hidden.dim, hidden.blocks, hidden.outer) == ("perm", I, E, [groups.id, within.id])
    assert f"{mlp}.gate.e_score_correction_bias" in r.buffers
    # swap the experts of group 0 (experts 0 and 1); group 1's stay
    el = torch.eye(2, dtype=torch.float64).repeat(2, 1, 1)
    el[0] = perm_matrix([1, 0])
    new, old = moved_by(r, model, within, el)
    names = {f"{mlp}.gate.weight", f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj"}
    assert unchanged_but(new, old, names | {f"{mlp}.gate.e_score_correction_bias"}) == []
    for k in names | {f"{mlp}.gate.e_score_correction_bias"}:
        torch.testing.assert_close(new[k], old[k][[1, 0, 2, 3]], rtol=0, atol=0)
    # expert 2 (group 1, second... first expert of group 1) alone takes SIGMA on its hidden units
    P = perm_matrix(SIGMA)
    el = torch.eye(I, dtype=torch.float64).repeat(2, 2, 1, 1)
    el[1, 0] = P
    new, old = moved_by(r, model, hidden, el)
    assert unchanged_but(new, old, {f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj"}) == []
    gu, dn = old[f"{mlp}.experts.gate_up_proj"], old[f"{mlp}.experts.down_proj"]
    want_gu, want_dn = gu.clone(), dn.clone()
    want_gu[2] = torch.cat([P @ gu[2][:I], P @ gu[2][I:]])
    want_dn[2] = dn[2] @ P.T
    torch.testing.assert_close(new[f"{mlp}.experts.gate_up_proj"], want_gu)
    torch.testing.assert_close(new[f"{mlp}.experts.down_proj"], want_dn)


def test_latent_attention_with_low_rank_queries_has_head_classes(v3):
    model, r = v3
    attn = "model.layers.0.self_attn"
    heads = next(g for g in r.groups if g.kind == "perm" and (f"{attn}.kv_b_proj.weight", 0) in g.params)
    assert (heads.size, heads.blocks) == (4, 1)
    assert {(f"{attn}.q_b_proj.weight", 0), (f"{attn}.o_proj.weight", 1)} <= set(heads.params)
    kinds = sorted((g.kind, g.dim, g.blocks) for g in r.groups if g.outer == [heads.id])
    assert kinds == [("gl", 4, 4), ("gl", 6, 4)]  # QK's nope part and VO, per head


def test_nested_matching_of_three_levels_recovers_a_permuted_copy():
    """Groups, experts within a group, each expert's hidden units: B is A with each level
    permuted within the blocks of the levels above it; nested matching finds every level."""
    G, n, m, k = 3, 2, 5, 7
    g = torch.Generator().manual_seed(0)
    XA = torch.randn(G, n, m, k, generator=g, dtype=torch.float64)  # the hidden units' features
    RA = torch.randn(G, n, k, generator=g, dtype=torch.float64)  # the experts' own (router rows)
    pg = torch.randperm(G, generator=g)  # B's group b is A's group pg[b]
    pe = torch.stack([torch.randperm(n, generator=g) for _ in range(G)])  # expert j of B's group b is A's pe[b, j]
    ph = torch.stack([torch.stack([torch.randperm(m, generator=g) for _ in range(n)]) for _ in range(G)])
    XB = torch.stack([torch.stack([XA[pg[b], pe[b, j]][ph[b, j]] for j in range(n)]) for b in range(G)])
    RB = torch.stack([RA[pg[b]][pe[b]] for b in range(G)])
    S_hidden = torch.einsum("aiuk,bjvk->aibjuv", XA, XB).reshape(G * n, G * n, m, m)
    S_experts = torch.einsum("aik,bjk->abij", RA, RB)
    for own in (S_experts, None):  # with the experts' own features, and with none
        out, (experts, hidden) = nested_tree([own, S_hidden], ["perm", "perm"], [None, None], [-1, 0],
                                             [(n, n), (m, m)], (G, G))
        assert torch.equal(out.element.argmax(0), pg)
        assert torch.equal(experts.element.argmax(-2), pe)  # [G_B, n_A, n_B]: B's expert j -> A's
        assert torch.equal(hidden.element.argmax(-2).reshape(G, n, m), ph)


@pytest.mark.slow
def test_group_limited_routing_with_full_rank_queries_recovered_by_weights_and_activations():
    A = randomized(deepseek_v3(q_lora_rank=None))
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"


def test_latent_attention_behind_small_norm_gains_recovered_by_weights(monkeypatch):
    """Low-rank queries and a key-value latent, each behind an RMSNorm with one gain of 1e-3:
    the heads' GL maps are fitted on the folded weights, where the latent rotations are solved
    (on the stored ones that coordinate weighed 1e6 times more in the fit than in the rotation's
    solve, and the alternation stopped 0.23 off), and started from latent rotations and a
    shared RoPE rotation solved from the slots that read no head map: exact after the first
    round, confirmed by the second."""
    import symgraph.alignment.fullgroups as fullgroups
    A = randomized(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=6, max_position_embeddings=32)), seed=1).double()
    attn = A.model.layers[0].self_attn
    with torch.no_grad():
        attn.kv_a_layernorm.weight[3] = attn.q_a_layernorm.weight[5] = 1e-3
    rep = symgraph.analyze(A)
    assert sorted(g.kind for g in rep.groups if not g.outer and g.kind != "perm") == ["orthogonal"] * 3 + ["rope"]
    T = rep.random_transform(seed=0)
    B = symgraph.transform(A, T)
    assert _rel(A, B) > 0.1
    fits = []
    real = fullgroups.fit_gl
    monkeypatch.setattr(fullgroups, "fit_gl", lambda *a: fits.append(1) or real(*a))
    al = symgraph.align(A, B, report_a=rep, full_groups=True)
    assert _rel(A, al.apply(B)) < 1e-12
    assert len(fits) == 3  # from the orthogonal solutions, then two rounds
    for g in rep.groups:
        if not g.outer and g.kind in ("orthogonal", "rope"):
            torch.testing.assert_close(al.elements[g.id], torch.linalg.inv(T.elements[g.id].double()),
                                       rtol=0, atol=1e-12)


@pytest.mark.slow
def test_group_limited_routing_recovered_by_weights_and_activations():
    """Latent attention with low-rank queries: the residual stream's rotation, the query and
    key-value latent spaces (rotations after q_a_layernorm and kv_a_layernorm; layer 0's
    kv_a_layernorm has a gain of 8e-4), the RoPE rotation shared by every head and each head's
    QK and VO maps, recovered exactly with the nested routing. The latent rotations are the transform's own inverses (B = T(A))."""
    A = randomized(deepseek_v3())
    rep = symgraph.analyze(A)
    T = rep.random_transform(seed=0)
    B = symgraph.transform(A, T)
    assert _rel(A, B) > 0.1
    latent = [g for g in rep.groups if g.kind in ("orthogonal", "rope") and not g.outer]
    # per layer: the query latent, the key-value latent, the shared RoPE; and the residual stream,
    # whose norms fold although the router reads its weight through a cast (``weight.float()``)
    assert len(latent) == 7 and sum(g.module == "" for g in latent) == 1
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"
        for g in latent:
            want = torch.linalg.inv(T.elements[g.id].double())
            torch.testing.assert_close(al.elements[g.id].double(), want, rtol=0, atol=1e-6)

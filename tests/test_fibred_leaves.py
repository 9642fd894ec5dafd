"""Weight matching's view of a slot whose other leaves include a class fibred over another of
them (issue 65's round trip: Qwen3-Next's gated delta net, its value heads permuted within each
key head, its value dims alike in every head). The fibred element's fibres index B's order of
the class it is fibred over, so it must be applied before that class moves B's dim: in the
other order a moved copy aligned back by weights came back 1.7 off wherever the value-head
permutations differed between key heads, its output unchanged (another element of the group)."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.alignment.products import gather
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def test_a_leaf_fibred_over_another_is_applied_first():
    """``x [n, K, V, m]``, B's K moved by ``s`` and each K's V by ``p[k]`` (indexed by B's k):
    gathered with those elements, B's coordinates land in A's order."""
    torch.manual_seed(0)
    n, K, V, m = 3, 2, 2, 5
    a = torch.randn(n, K, V, m)
    s, p = torch.tensor([1, 0]), torch.tensor([[0, 1], [1, 0]])  # B's (k, v) holds A's (s[k], p[k][v])
    b = torch.empty_like(a)
    for k in range(K):
        for v in range(V):
            b[:, k, v] = a[:, s[k], p[k][v]]
    eye = torch.eye(K)
    S = eye[s].T  # S[new, old]: A's coordinate from B's
    P = torch.stack([torch.eye(V)[p[k]].T for k in range(K)])  # fibre k: B's key head k
    idx = torch.arange(n * K * V).reshape(n, K, V)
    flat_b = b.reshape(n * K * V, m)
    got = gather(flat_b, 0, idx, 0, [(0, S, []), (1, P, [1])])
    assert torch.equal(got, a.reshape(n, -1))


def _tiny_qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, intermediate_size=64)
    torch.manual_seed(0)
    return randomized(transformers.Qwen3NextForCausalLM(cfg), dtype=torch.float32).eval()


@pytest.mark.slow
def test_qwen3_next_moved_copy_is_recovered_by_weights(seed=1):
    a = _tiny_qwen3_next()
    rep = symgraph.analyze(a)
    fibred = [g for g in rep.groups if any(f is not None for f in rep.fibre_groups(g.id))]
    assert len(fibred) >= 4  # per layer: value heads and key dims, fibred over the key heads
    b = symgraph.transform(a, rep.random_transform(seed=seed, orthogonal=True))
    c = symgraph.align(a, b, report_a=rep, report_b=rep).apply(b)
    err = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), c.parameters()))
    assert err < 1e-6, err

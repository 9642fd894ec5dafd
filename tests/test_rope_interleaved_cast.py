"""Issue 46, part 2: ERNIE 4.5's RoPE, interleaved (``stack((-x[..., 1::2], x[..., ::2]), -1)
.flatten(-2)``, pairs ``(2i, 2i+1)``) with the rotated operand cast after the rotation
(``rotate_half(q).float()``: a ``to`` node, and a metadata check reading the flattened value).
The pattern read neither: the head dimension fell apart into strided slices (fixed) and the
model had no QK class at all. Casts are copies of the rotated value, and metadata checks read
no value, so it is one rope class per key head, pairs of neighbours.

(a) the exact pairs and rows, by applying a rotation of one pair of one key head;
(b) a random transform certified and recovered by weights and by activations."""
from __future__ import annotations

import math

import torch
import transformers as tf

import symgraph
from symgraph.report.symmetry import Transform
from test_families_full_groups import _batches, _rel

V, D, H, KV, HD = 64, 32, 4, 2, 8


def ernie():
    model = tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(
        vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=1, num_attention_heads=H,
        num_key_value_heads=KV, head_dim=HD, max_position_embeddings=32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def ids():
    return {"input_ids": torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))}


def test_ernie_interleaved_rope_pairs_neighbours_per_key_head():
    model = ernie().double()
    r = symgraph.analyze(model, ids())
    assert r.frozen == [] and r.certify(model, ids()) < 1e-12
    attn = "model.layers.0.self_attn"
    (rope,) = [g for g in r.groups if g.kind == "rope" and g.module.startswith(attn)]
    assert (rope.dim, rope.blocks) == (HD, KV) and rope.pairs == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert set(rope.params) == {(f"{attn}.q_proj.weight", 0), (f"{attn}.k_proj.weight", 0)}
    # key head 1 turns its pair (2, 3) by 0.7 rad: rows 2, 3 of key head 1 and of query heads
    # 2, 3 (its group) move, nothing else
    c, s = math.cos(0.7), math.sin(0.7)
    el = torch.eye(HD, dtype=torch.float64).repeat(KV, 1, 1)
    el[1, 2:4, 2:4] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    new = symgraph.transform(model, Transform(r, {rope.id: el})).state_dict()
    old = model.state_dict()
    q, k = f"{attn}.q_proj.weight", f"{attn}.k_proj.weight"
    assert [n for n in old if n not in (q, k) and not torch.equal(new[n], old[n])] == []
    want_q, want_k = old[q].clone().view(H, HD, D), old[k].clone().view(KV, HD, D)
    for h in (2, 3):
        want_q[h, 2:4] = el[1, 2:4, 2:4] @ want_q[h, 2:4]
    want_k[1, 2:4] = el[1, 2:4, 2:4] @ want_k[1, 2:4]  # a rotation is its own inverse transpose
    torch.testing.assert_close(new[q], want_q.view(-1, D))
    torch.testing.assert_close(new[k], want_k.view(-1, D))


def test_ernie_recovered_by_weights_and_activations():
    A = ernie()
    rep = symgraph.analyze(A)
    assert any(g.kind == "rope" for g in rep.groups)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1 and rep.certify(B) < 1e-12
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-5, "weights" if data is None else "activations"

"""Issue 46, part 2: fused QKV layouts whose head classes the coverage table missed.

- Persimmon (and BLOOM) pack Q, K and V head by head: ``qkv(x).view(b, s, H, 3, d)`` then
  ``select(3, i)``. The count (3) comes after the heads, so the packed axis is
  ``H × (d ⊕ d ⊕ d)``: one head axis for Q, K and V (the layout moves a head's three blocks
  together) and a part per entry, fibred over the heads. Before, the three entries shared one
  head-dimension class (V's GL tied to Q/K's norm-narrowed permutation).
- GPT-BigCode's multi-query attention (one fused ``c_attn`` of ``H·d + d + d`` rows, the one key
  and value head broadcast by ``expand``): the heads are one permutation class and the shared
  key/value head's maps are one element for every head (no class can be per head). The graph
  had them; the coverage check asked for a per-head class, which multi-query cannot have.

Each: (a) the exact mapping, by applying a known element of one class and reading which
entries moved; (b) a random transform certified and recovered by alignment."""
from __future__ import annotations

import torch
import transformers as tf

import symgraph
from symgraph.report.symmetry import Transform
from test_families_full_groups import _batches, _rel
from symgraph.testing.models import randomized as shared_randomized

V, D, H, HD = 64, 32, 4, 8



def randomized(model, seed=0):
    """HF initialises norms to ones and some weights to zero: every parameter drawn, float32."""
    return shared_randomized(model, seed, dtype=torch.float32)


def persimmon():
    return randomized(tf.PersimmonForCausalLM(tf.PersimmonConfig(
        vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=H,
        max_position_embeddings=32, partial_rotary_factor=0.5, qk_layernorm=True)))


def bigcode():
    return randomized(tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
        vocab_size=V, n_embd=D, n_inner=48, n_layer=2, n_head=H, n_positions=32, multi_query=True)))


def ids():
    return {"input_ids": torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))}


def moved(report, model, group, element):
    new = symgraph.transform(model, Transform(report, {group.id: element.double()}))
    return new.state_dict(), model.state_dict()


def unchanged_but(new, old, names):
    """Tensors outside ``names`` that moved (beyond the round-off of folding the norms' gains
    into their readers and back)."""
    return [k for k in old if k not in names and not torch.allclose(new[k], old[k], rtol=0, atol=1e-12)]


def perm_matrix(index):
    return torch.eye(len(index), dtype=torch.float64)[torch.as_tensor(index)]


SIGMA = [2, 0, 3, 1]


# --- Persimmon: view(b, s, H, 3, d), select(3, i) -------------------------------------------

def test_persimmon_heads_interleaved_qkv_are_a_head_class_and_a_vo_class_per_head():
    model = persimmon().double()
    r = symgraph.analyze(model, ids())
    assert r.frozen == [] and r.certify(model, ids()) < 1e-12
    attn = "model.layers.0.self_attn"
    qkv, dense = f"{attn}.query_key_value", f"{attn}.dense"
    # the 3·H·d axis: heads × (Q part ⊕ K part ⊕ V part)
    assert r.axis_structure(r.param_axes(f"{qkv}.weight")[0]) == ("prod", [H, 3 * HD])
    heads = next(g for g in r.groups if g.kind == "perm" and g.dim == H and (f"{qkv}.weight", 0) in g.params)
    vo = next(g for g in r.groups if g.outer == [heads.id] and (f"{dense}.weight", 1) in g.params)
    assert (vo.kind, vo.dim, vo.blocks) == ("gl", HD, H)
    assert {(f"{qkv}.weight", 0), (f"{qkv}.bias", 0), (f"{dense}.weight", 1)} == set(vo.params)
    # a head permutation moves each head's Q, K and V rows together (and O's columns); the
    # per-dimension query/key norms are shared by the heads and stay
    new, old = moved(r, model, heads, perm_matrix(SIGMA))
    names = {f"{qkv}.weight", f"{qkv}.bias", f"{dense}.weight"}
    assert unchanged_but(new, old, names) == []
    torch.testing.assert_close(new[f"{qkv}.weight"], old[f"{qkv}.weight"].view(H, 3 * HD, D)[SIGMA].reshape(-1, D))
    torch.testing.assert_close(new[f"{qkv}.bias"], old[f"{qkv}.bias"].view(H, 3 * HD)[SIGMA].reshape(-1))
    torch.testing.assert_close(new[f"{dense}.weight"], old[f"{dense}.weight"].view(D, H, HD)[:, SIGMA].reshape(D, -1))
    # head 1 alone takes A on its values: its V rows (entry 2 of its three) and its block of O's columns
    A = torch.eye(HD, dtype=torch.float64) + 0.3 * torch.randn(HD, HD, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    el = torch.eye(HD, dtype=torch.float64).repeat(H, 1, 1)
    el[1] = A
    new, old = moved(r, model, vo, el)
    assert unchanged_but(new, old, names) == []
    w, nw = old[f"{qkv}.weight"].view(H, 3, HD, D), new[f"{qkv}.weight"].view(H, 3, HD, D)
    want = w.clone()
    want[1, 2] = A @ w[1, 2]
    torch.testing.assert_close(nw, want)
    b, nb = old[f"{qkv}.bias"].view(H, 3, HD), new[f"{qkv}.bias"].view(H, 3, HD)
    want = b.clone()
    want[1, 2] = A @ b[1, 2]
    torch.testing.assert_close(nb, want)
    o, no = old[f"{dense}.weight"].view(D, H, HD), new[f"{dense}.weight"].view(D, H, HD)
    want = o.clone()
    want[:, 1] = o[:, 1] @ torch.linalg.inv(A)
    torch.testing.assert_close(no, want)


def test_persimmon_recovered_by_weights_and_activations():
    A = persimmon()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1 and rep.certify(B) < 1e-12
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"


# --- GPT-BigCode: multi-query attention in one fused projection ------------------------------

def test_bigcode_multi_query_heads_permute_query_rows_only():
    model = bigcode().double()
    r = symgraph.analyze(model, ids())
    assert r.frozen == [] and r.certify(model, ids()) < 1e-12
    attn = "transformer.h.0.attn"
    ca, cp = f"{attn}.c_attn", f"{attn}.c_proj"
    # c_attn's H·d + d + d rows: the query heads (a product), the key head, the value head
    assert r.axis_structure(r.param_axes(f"{ca}.weight")[0]) == ("sum", [H * HD, HD, HD])
    heads = next(g for g in r.groups if g.kind == "perm" and g.dim == H and (f"{ca}.weight", 0) in g.params)
    assert heads.blocks == 1
    # the shared key/value head: one GL class each, not fibred over the heads
    inner = sorted((g.kind, g.dim, g.blocks) for g in r.groups if g.module.startswith(attn) and g.kind == "gl")
    assert inner == [("gl", HD, 1), ("gl", HD, 1)]
    new, old = moved(r, model, heads, perm_matrix(SIGMA))
    names = {f"{ca}.weight", f"{ca}.bias", f"{cp}.weight"}
    assert unchanged_but(new, old, names) == []
    w, nw = old[f"{ca}.weight"], new[f"{ca}.weight"]
    torch.testing.assert_close(nw[:H * HD], w[:H * HD].view(H, HD, D)[SIGMA].reshape(-1, D))
    torch.testing.assert_close(nw[H * HD:], w[H * HD:])  # the key and value head stay
    torch.testing.assert_close(new[f"{cp}.weight"], old[f"{cp}.weight"].view(D, H, HD)[:, SIGMA].reshape(D, -1))


def test_bigcode_recovered_by_weights_and_activations():
    A = bigcode()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1 and rep.certify(B) < 1e-12
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, "weights" if data is None else "activations"


# --- a multi-query projection taken apart by split (Falcon since transformers 5.25) ----------

class SplitMQA(torch.nn.Module):
    """One fused ``H·d + d + d`` projection viewed as ``(H + 2) × d`` and taken apart by
    ``split([H, 1, 1], dim=-2)`` (``form="split"``, Falcon's multi-query attention since
    transformers 5.25) or by a slice and literal index lists (``"index"``, before it); the key
    and value heads broadcast to every query head."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.emb, self.ln = torch.nn.Embedding(V, D), torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, (H + 2) * HD, bias=False)
        self.o, self.head = torch.nn.Linear(D, D, bias=False), torch.nn.Linear(D, V)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        (b, s), qkv = input_ids.shape, self.qkv(self.ln(h)).view(*input_ids.shape, -1, HD)
        if self.form == "split":
            q, k, v = qkv.split([H, 1, 1], dim=-2)
        else:
            q, k, v = qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.expand(b, H, s, HD) for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + self.o(a.transpose(1, 2).reshape(b, s, D)))


def test_a_multi_query_split_by_sizes_has_the_classes_of_its_index_form():
    """The packed axis is ``H·d ⊕ d ⊕ d`` whichever way it is taken apart: the query heads a
    permutation class, Q/K one GL class (no RoPE here), the shared value head a GL class of its
    own (before ``split`` was read as a packed split, one head-dimension class served Q, K and
    V: an orthogonal map); a random element certified and recovered by alignment."""
    kinds = {}
    for form in ("split", "index"):
        torch.manual_seed(0)
        A = randomized(SplitMQA(form))
        rep = symgraph.analyze(A, ids())
        kinds[form] = sorted((g.kind, g.dim, g.blocks) for g in rep.groups)
        assert rep.axis_structure(rep.param_axes("qkv.weight")[0]) == ("sum", [H * HD, HD, HD]), form
        B = symgraph.transform(A, rep.random_transform(seed=0))
        assert _rel(A, B) > 0.1 and rep.certify(B, ids()) < 1e-12
        al = symgraph.align(A, B, ids(), report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, form
    assert kinds["split"] == kinds["index"]
    assert [k for k in kinds["split"] if k[1] == HD] == [("gl", HD, 1), ("gl", HD, 1)]

"""XLNet's relative attention: heads stored on their own axis (issue 65).

XLNet keeps its projections as 3-d parameters ``q, k, v, o, r [d_model, heads, head_dim]``
contracted by ``einsum``, and per-head vectors ``r_w_bias, r_r_bias, r_s_bias [heads,
head_dim]`` and ``seg_embed [2, heads, head_dim]``. The scores of head ``n`` are
``(q_n + r_w_bias_n)·k_n + (q_n + r_r_bias_n)·(pos W_r)_n + (q_n + r_s_bias_n)·seg_embed_n``:
a map ``M_n`` of head ``n``'s query side (``q``, the three biases) with ``M_n^{-T}`` on its key
side (``k``, ``r``, ``seg_embed``) keeps every term, one ``M_n`` per head; the values and the
output projection take another map per head. The einsum reads ``q`` through a view as
``d_model × (heads · head_dim)``, so the head dims are fibred over the heads, and the stored
tensors, which hold the heads on another axis, are viewed as that product
(:func:`symgraph.passes.patterns.stacked.stack`): before, the head dims kept one map for
every head and the coverage table counted XLNet's attention heads missing.

Asserted: the classes (kind, per-head size, blocks, outer class), the maps of a transform per
head on every slot, the certificate in float64, and a transformed copy recovered by weights.
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.report.symmetry import Transform
from test_families_full_groups import _rel

transformers = pytest.importorskip("transformers")

D, H, HD, V = 16, 4, 4, 64
ATTN = "transformer.layer.{}.rel_attn"
QK_SIDE = {"q": 1, "k": 1, "r": 1, "seg_embed": 1, "r_w_bias": 0, "r_r_bias": 0, "r_s_bias": 0}


def xlnet(cls="XLNetLMHeadModel", seed=0):
    cfg = transformers.XLNetConfig(vocab_size=V, d_model=D, n_layer=2, n_head=H, d_head=HD, d_inner=24,
                                   dropout=0.0, num_labels=3)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # XLNet initialises the biases to zeros: give every slot values
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


@pytest.fixture(scope="module")
def lm():
    # float32: XLNet's own query stream (target_mapping) refuses float64 weights (an einsum of a
    # float32 tensor it makes); certify runs in float64 by itself
    model = xlnet()
    return model, symgraph.analyze(model)


def only(groups, kind):
    (g,) = [g for g in groups if g.kind == kind]
    return g


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.slow
def test_head_dims_are_fibred_over_the_heads(lm, layer):
    model, r = lm
    at = ATTN.format(layer)
    heads = only(r.group_of(f"{at}.o", 1), "perm")
    assert (heads.dim, heads.blocks, heads.outer) == (H, 1, [])
    qk = only(r.group_of(f"{at}.q", 2), "gl")
    vo = only(r.group_of(f"{at}.v", 2), "gl")
    assert qk.id != vo.id
    for g in (qk, vo):
        assert (g.dim, g.blocks, g.size, g.outer) == (HD, H, H * HD, [heads.id])
    for p, d in QK_SIDE.items():  # stored [.., heads, head_dim]: viewed as one (heads, head_dim) axis
        assert r.stacked[f"{at}.{p}"] == (d, d + 1)
        assert r.group_of(f"{at}.{p}", d + 1) == [qk]
        assert heads in r.group_of(f"{at}.{p}", d)
    assert r.group_of(f"{at}.o", 2) == [vo]
    attn = [(g.kind, g.size, g.blocks) for g in r.groups if g.module == at]
    assert sorted(attn) == sorted([("perm", H, 1), ("gl", H * HD, H), ("gl", H * HD, H)])


def test_certified_in_float64(lm):
    model, r = lm
    assert r.frozen == []
    assert r.certify(model, tol=1e-9) < 1e-9


def test_each_head_takes_its_own_map_on_every_slot(lm):
    """A transform of the QK class only: per head ``n`` one invertible ``M_n`` with
    ``q_n M_n`` and the biases ``b_n M_n`` on the query side, ``k_n M_n^{-T}`` (and ``r``,
    ``seg_embed``) on the key side; the heads' maps differ; nothing else moves."""
    model, r = lm
    at = ATTN.format(0)
    qk = only(r.group_of(f"{at}.q", 2), "gl")
    el = r.random_transform(seed=3).elements[qk.id]
    new = {k: v.double() for k, v in symgraph.transform(model, Transform(r, {qk.id: el})).state_dict().items()}
    old = {k: v.double() for k, v in model.state_dict().items()}
    maps = []
    for n in range(H):
        q, q2 = old[f"{at}.q"][:, n], new[f"{at}.q"][:, n]
        M = torch.linalg.lstsq(q, q2).solution
        torch.testing.assert_close(q @ M, q2, rtol=0, atol=1e-5)
        inv_t = torch.linalg.inv(M).T
        for p in ("k", "r"):
            torch.testing.assert_close(new[f"{at}.{p}"][:, n], old[f"{at}.{p}"][:, n] @ inv_t, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(new[f"{at}.seg_embed"][:, n], old[f"{at}.seg_embed"][:, n] @ inv_t,
                                   rtol=1e-4, atol=1e-5)
        for b in ("r_w_bias", "r_r_bias", "r_s_bias"):
            torch.testing.assert_close(new[f"{at}.{b}"][n], old[f"{at}.{b}"][n] @ M, rtol=1e-4, atol=1e-5)
        maps.append(M)
    assert min(float((maps[i] - maps[j]).norm()) for i in range(H) for j in range(i)) > 0.1
    assert float((maps[0] - torch.eye(HD, dtype=maps[0].dtype)).norm()) > 0.1
    moved = {f"{at}.{p}" for p in QK_SIDE}
    assert [k for k in old if k not in moved and not torch.equal(new[k], old[k])] == []


@pytest.mark.parametrize("cls", ["XLNetLMHeadModel", "XLNetForSequenceClassification"])
@pytest.mark.slow
def test_transformed_copy_recovered_by_weights(cls):
    A = xlnet(cls)
    rep = symgraph.analyze(A)
    assert rep.certify(A, tol=1e-6) < 1e-6
    assert sum(g.blocks == H and g.kind == "gl" for g in rep.groups) == 4  # QK and VO of two layers
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    al = symgraph.align(A, B, report_a=rep, full_groups=True)
    assert _rel(A, al.apply(B)) < 1e-6
    # the merge engine reads the stored [d_model, heads, head_dim] tensors through their views
    assert _rel(A, symgraph.merge([A, B], full_groups=True).model) < 1e-6

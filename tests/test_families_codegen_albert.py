"""Two families no other test names, found sound in a new user's hour (issues 61/65): CodeGen
(a QKV projection packed in ``mp_num`` groups, RoPE on only the first ``rotary_dim`` channels of
each head, attention and MLP reading one norm in parallel) and ALBERT (one layer's weights used
by every layer, a factorised embedding projected up to the hidden size). Each is certified in
float64, has the groups it must have, and a copy moved by a random element of every group is
recovered exactly by weight matching."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def ids():
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


def recovered(model, report, inputs):
    moved = symgraph.transform(model, report.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(model, moved, inputs, outputs=report.outputs, max_iter=30)
    got, want, was = al.apply(moved).state_dict(), model.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    return max((got[k] - want[k]).abs().max().item() for k in want)


def kinds(report):
    return sorted((g.kind, g.dim, g.blocks) for g in report.groups)


def test_codegen_partial_rope_in_packed_qkv():
    cfg = transformers.CodeGenConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, n_ctx=16,
                                     rotary_dim=4)
    m = randomized(transformers.CodeGenForCausalLM(cfg))
    x = (ids(),)
    r = symgraph.analyze(m, x)
    assert not r.frozen
    # 4 heads of 8 channels: RoPE on 4 of Q-K (rotary_dim), GL(4) on the other 4; GL(8) on V-O
    assert kinds(r) == [("gl", 4, 4), ("gl", 8, 4), ("orthogonal_mean", 32, 1), ("perm", 4, 1),
                        ("perm", 128, 1), ("rope", 4, 4)]
    assert r.certify(m, x, tol=1e-9) < 1e-9
    assert recovered(m, r, x) < 1e-9


def test_albert_one_layer_shared_by_all():
    cfg = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)
    m = randomized(transformers.AlbertForMaskedLM(cfg))
    x = (ids(),)
    r = symgraph.analyze(m, x)
    assert not r.frozen
    # one set of groups for the shared layer, used twice; the embedding's 16 and the stream's 32
    assert kinds(r) == [("gl", 8, 4), ("gl", 8, 4), ("perm", 4, 1), ("perm", 16, 1), ("perm", 32, 1),
                        ("perm", 48, 1)]
    assert r.certify(m, x, tol=1e-9) < 1e-9
    assert recovered(m, r, x) < 1e-9

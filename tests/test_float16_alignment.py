"""Weight matching of float16 models computes its products in float32: float16's range (65504)
overflows in the products of weights of a few tens, which float32 (and bfloat16) hold. Such a
pair was refused ("similarity matrix ... holds NaN/inf") while the same weights in float32
merged."""
from __future__ import annotations

import copy

import torch

import symgraph
from symgraph.testing import models

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


def scaled(seed, dtype):
    m = models.build("llama", seed=seed, **L)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(300)
    return m.to(dtype)


def test_large_float16_weights_align_as_their_float32_copy():
    a16, b16 = scaled(0, torch.float16), scaled(1, torch.float16)
    assert all(torch.isfinite(p).all() for p in b16.parameters())
    al16 = symgraph.align(a16, b16)
    al32 = symgraph.align(copy.deepcopy(a16).float(), copy.deepcopy(b16).float())  # .float() is in place
    perms = [[g.get("permutation") for g in al.to_dict()["groups"]] for al in (al16, al32)]
    assert perms[0] == perms[1] and any(p is not None for p in perms[0])  # the MLP classes matched alike
    merged = symgraph.merge([a16, b16]).model
    assert next(merged.parameters()).dtype == torch.float16

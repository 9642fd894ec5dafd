"""bench_rotate's pieces (issue 64): the PyTorch stand-in for QuaRot's CUDA Hadamard transform
is Sylvester's matrix, as the kernel computes it; the quantized loss of W8A8 stays near float
and W4A4 costs more on a tiny model; the table names the command and the commit."""
from __future__ import annotations

import torch

from benchmarks.bench_rotate import SETTINGS, markdown
from benchmarks.rotate_quarot import _fht
from symgraph.core.hadamard import hadamard
from symgraph.testing import models
from symgraph.testing import quantize as Q


def test_fast_hadamard_stand_in_is_sylvester():
    for n in (1, 2, 8, 64):
        assert torch.equal(_fht(torch.eye(n, dtype=torch.float64)), hadamard(n))
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_fht(x, 0.25), x @ hadamard(16).float() * 0.25, atol=1e-6)


def test_quantized_losses_order():
    m = models.build("llama", seed=0, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, positions=32)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(w, a):
        q = m if w is None else Q.quantize_weights(m, w, 128)
        with torch.no_grad(), Q.activations(q, a) if a else torch.no_grad():
            return float(q(input_ids=x, labels=x).loss)
    base = loss(None, None)
    assert abs(loss(8, 8) - base) < abs(loss(4, 4) - base)
    assert loss(4, 4) != base


def test_markdown_names_command_and_commit():
    row = {"loss": {s: 1.0 for s in SETTINGS}, "w4_gap_closed": None}
    rec = {"command": "python -m benchmarks.bench_rotate", "commit": {"commit": "abc", "dirty": False},
           "train_steps": 150, "notes": "n", "archs": [{"arch": "llama", "rows": {"none": row}}]}
    text = markdown(rec)
    assert "`python -m benchmarks.bench_rotate`" in text and "`abc`" in text and "| llama | none |" in text

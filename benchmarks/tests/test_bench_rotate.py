"""bench_rotate's pieces (issue 64): the PyTorch stand-in for QuaRot's CUDA Hadamard transform
is Sylvester's matrix, as the kernel computes it; the quantized loss of W8A8 stays near float
and W4A4 costs more on a tiny model; the table names the command and the commit."""
from __future__ import annotations

import torch

from benchmarks.bench_rotate import GAP_MIN, NOISE_ROW, NOISE_TIMES, SETTINGS, gaps, markdown
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


def _rows(**by_how):
    """Rows of losses: each ``how`` its float and quantized losses (one value for every setting but float)."""
    return {h: {"loss": {"float": 1.0, **{s: v for s in SETTINGS if s != "float"}}} for h, v in by_how.items()}


def test_gaps_share_noise_and_resolution():
    rows = _rows(none=1.1, hadamard=1.02, random=1.03, **{NOISE_ROW: 1.04})
    g = gaps(rows)["W4A8"]
    assert abs(g["gap"] - 0.1) < 1e-12 and abs(g["noise"] - 0.01) < 1e-12
    assert g["resolved"]  # 0.1 >= max(GAP_MIN, NOISE_TIMES * 0.01)
    assert abs(g["closed"]["hadamard"] - 0.8) < 1e-9 and abs(g["closed"]["random"] - 0.7) < 1e-9
    assert abs(g["delta"]["hadamard"] + 0.08) < 1e-12
    small = gaps(_rows(none=1.0 + GAP_MIN / 2, random=1.0, **{NOISE_ROW: 1.0}))["W4"]
    assert not small["resolved"]  # below the absolute floor
    noisy = gaps(_rows(none=1.05, random=1.0, **{NOISE_ROW: 1.05 / NOISE_TIMES + 0.99}))["W4"]
    assert noisy["noise"] * NOISE_TIMES > noisy["gap"] and not noisy["resolved"]
    assert gaps(_rows(none=1.0, hadamard=0.9))["W4"]["closed"]["hadamard"] is None  # no gap: no share


def test_markdown_names_command_and_commit():
    plain = _rows(none=1.1, hadamard=1.02, random=1.03, **{NOISE_ROW: 1.04})
    tiny = _rows(none=1.0 + GAP_MIN / 4, hadamard=1.0, random=1.0, **{NOISE_ROW: 1.0})
    rec = {"command": "python -m benchmarks.bench_rotate", "commit": {"commit": "abc", "dirty": False},
           "train_steps": 150, "notes": "n",
           "archs": [{"arch": "llama", "variants": {"plain": {"rows": plain, "gaps": gaps(plain)},
                                                     "outliers": {"rows": tiny, "gaps": gaps(tiny)}}},
                     {"arch": "bert", "variants": {"outliers": {"skipped": "no foldable norm"}}}]}
    text = markdown(rec)
    assert "`python -m benchmarks.bench_rotate`" in text and "`abc`" in text
    assert "| llama | plain | none |" in text and "| bert | outliers | (none: no foldable norm) |" in text
    assert "| llama | plain | W4A8 | 0.1000 | 0.0100 | 80% | 70% | 60% |" in text
    assert f"| llama | outliers | W4 | {GAP_MIN / 4:.4f} | 0.0000 | Δ{-GAP_MIN / 4:+.4f} |" in text

"""Gemma's RMSNorm reads its gain with an offset, ``x · (1 + w)`` (issue 64): the analysis folds
``diag(1 + w)`` into the norm's readers (``Fold.offset`` 1), so an untied Gemma's residual stream
admits all of O(d). Aligning and merging use the fold like any other: a random orthogonal
transform of the model is recovered exactly, and the merge out of core equals the one in memory."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.testing import models

from engine_helpers import load, rel

transformers = pytest.importorskip("transformers")


def gemma(seed: int):
    torch.manual_seed(seed)
    m = transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, intermediate_size=48, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False))
    return models.randomize_vectors(m.eval(), seed=10 + seed)


def _distance(a, b) -> float:
    num = sum(((p.double() - q.double()) ** 2).sum() for p, q in zip(a.parameters(), b.parameters()))
    return float((num / sum((p.double() ** 2).sum() for p in a.parameters())).sqrt())


def test_untied_gemma_stream_is_orthogonal_and_recovered():
    A = gemma(0)
    rep = symgraph.analyze(A)
    assert len(rep.folds) == 5 and {f.offset for f in rep.folds} == {1.0}
    stream = [g for g in rep.groups if g.kind == "orthogonal" and g.size == 32]
    assert len(stream) == 1
    assert rep.certify(A) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=1, orthogonal=True))
    assert _distance(A, B) > 0.1
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = A(input_ids=x).logits.double(), B(input_ids=x).logits.double()
    assert float((la - lb).norm() / la.norm()) <= 1e-5
    for f in rep.folds:  # B keeps A's gains (the transform unfolds into the model's own)
        assert torch.allclose(B.get_parameter(f.gain), A.get_parameter(f.gain), atol=1e-6, rtol=0)
    assert _distance(A, symgraph.align(A, B, report_a=rep).apply(B)) < 1e-6


def test_gemma_merge_out_of_core_equals_in_memory(tmp_path):
    for i in range(2):
        gemma(i).save_pretrained(tmp_path / f"m{i}")
    cfg = MergeConfig(models=[str(tmp_path / "m0"), str(tmp_path / "m1")], out=str(tmp_path / "stream"))
    streamed = run_merge(cfg, progress=False)
    loaded = run_merge(cfg.model_copy(update={"out": str(tmp_path / "mem")}), streaming=False, progress=False)
    assert (streamed.mode, loaded.mode) == ("streaming", "in-memory")
    a, b = load(tmp_path / "stream"), load(tmp_path / "mem")
    assert rel(a, b) < 1e-5
    gains = [k for k in a if k.endswith("norm.weight")]
    assert len(gains) == 5 and all(torch.equal(a[k], gemma(0).get_parameter(k)) for k in gains)  # the anchor's gauge

"""``symgraph.merge`` over models in memory runs the one merge engine
(:class:`~symgraph.merging.streaming.StreamingMerge` over
:class:`~symgraph.checkpoints.memory.ModelCheckpoint` s): no second implementation, no file
written, the parents untouched."""
from __future__ import annotations

import os

import pytest
import torch

import symgraph
from symgraph.checkpoints.memory import ModelCheckpoint
from symgraph.errors import InputError
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models



def _mlp_pair():
    A, B = models.mlp(0, (6, 16, 12, 3)), models.mlp(1, (6, 16, 12, 3))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 6, generator=g),) for _ in range(3)]
    return A, B, data


@pytest.mark.parametrize("kw", [dict(method="average"), dict(method="regmean"), dict(method="fisher"),
                                dict(method="average", repair=True), dict(method="regmean", align=None)])
def test_in_memory_merge_is_the_engine_and_writes_no_file(kw, monkeypatch, tmp_path):
    """Every method goes through the engine's writer; its statistics stay in memory (nothing
    appears in the temporary directory or the working directory); the parents are untouched."""
    A, B, data = _mlp_pair()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (A, B)]
    calls = []
    real = StreamingMerge.write_into

    def spy(self, add, device=None):
        calls.append(type(self.checkpoints[0]))
        return real(self, add, device)
    monkeypatch.setattr(StreamingMerge, "write_into", spy)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    res = symgraph.merge([A, B], data=data, **kw)
    assert calls == [ModelCheckpoint]
    assert [n for n in os.listdir(tmp_path) if not n.startswith("torchinductor")] == []  # torch's own cache aside
    for m, sd in zip((A, B), before):
        assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())
    out = res.model(data[0][0])
    assert out.shape == (32, 3) and torch.isfinite(out).all()
    assert res.timings["total"] >= res.timings["combine"] > 0


def test_regmean_of_a_layer_reading_the_input_is_the_average():
    """A linear map that reads a graph input directly: every model's Gram is the data's own, so
    RegMean is the weighted average there (the engine once wrote a zero Gram for it, whose
    regularised inverse blew the layer up)."""
    A, B, data = _mlp_pair()
    w = [0.25, 0.75]
    reg = symgraph.merge([A, B], data=data, method="regmean", align=None, weights=w).model
    avg = symgraph.merge([A, B], data[0], align=None, weights=w).model
    first = next(k for k, _ in A.named_parameters())
    assert first.endswith("weight")
    assert torch.allclose(reg.state_dict()[first], avg.state_dict()[first], atol=1e-6)
    later = [k for k, p in A.named_parameters() if p.dim() == 2][1]
    assert not torch.allclose(reg.state_dict()[later], avg.state_dict()[later], atol=1e-4)  # Grams differ there


def test_model_checkpoint_reads_copies_and_refuses_non_finite():
    A = models.mlp(0, (6, 16, 12, 3))
    c = ModelCheckpoint(A, "model 0")
    k = c.keys[0]
    t = c.read(k)
    t.add_(1.0)
    assert not torch.equal(t, A.state_dict()[k])  # a copy: the model is untouched
    assert torch.equal(c.get(k, part=(0, 0, 2)), A.state_dict()[k][:2])
    with torch.no_grad():
        A.get_parameter(k)[0, 0] = float("nan")
    with pytest.raises(InputError, match="model 0 has 1 NaN/inf values"):
        ModelCheckpoint(A, "model 0").read(k)


def test_tied_llama_merge_keeps_the_tie_and_equals_the_average():
    """A tied model: the key once, the merged model still tied; unaligned = the plain average."""
    A, B = models.build("gpt2", 0), models.build("gpt2", 1)
    c = ModelCheckpoint(A, "a")
    tied = [names for names in c.params.values() if len(names) > 1]
    assert tied and all(sum(n in c.shapes for n in names) == 1 for names in tied)
    res = symgraph.merge([A, B], align=None)
    M = res.model
    assert M.get_output_embeddings().weight is M.get_input_embeddings().weight
    for k, p in M.named_parameters():
        assert torch.allclose(p, 0.5 * A.get_parameter(k) + 0.5 * B.get_parameter(k), atol=1e-6), k


def test_models_in_different_dtypes_merge_in_memory_as_out_of_core(tmp_path):
    """A float32 and a bfloat16 model merged in memory: the graphs run in the work dtype (the
    anchor's architecture retyped on meta), the merge has the anchor's dtypes, and it equals the
    out-of-core merge of the same models saved."""
    import symgraph
    from symgraph.app.run import merge_checkpoints
    from symgraph.testing import models as zoo
    sizes = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
    a = zoo.build("llama", seed=0, **sizes)
    b = zoo.build("llama", seed=1, **sizes).to(torch.bfloat16)
    merged = symgraph.merge([a, b]).model
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
    from safetensors.torch import load_file
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k, v in merged.state_dict().items():
        if k in out:
            torch.testing.assert_close(out[k], v, atol=1e-6, rtol=1e-6)

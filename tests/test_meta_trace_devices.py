"""The trace of a model built on ``meta`` (the merge engine's, from a checkpoint's headers) never
mixes devices: every input is traced on ``meta`` with the weights, real token ids included (torch
2.11's fake tensors refuse an embedding of meta weights at CPU ids: "Unhandled FakeTensor Device
Propagation for aten.embedding.default, found two different devices meta, cpu"), and the twin
that gives the meta trace its tensor constants (fake CPU weights) runs on CPU inputs (its trace on
the meta inputs as they were failed on torch 2.11, and the constants stayed unknown). A twin that
fails leaves the meta trace as it is."""
from __future__ import annotations

import pytest
import torch
import transformers

import symgraph
from index_constants import falcon_config, index_split_falcon
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.passes import trace as trace_mod

IDS = {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}


@pytest.fixture(autouse=True)
def _index_lists(monkeypatch):
    index_split_falcon(monkeypatch)  # a forward that creates index constants (Falcon's before 5.25)


def _falcon(tmp_path):
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(falcon_config(layers=1)).eval()
    model.save_pretrained(tmp_path / "a")
    return model, Checkpoint(str(tmp_path / "a")).model


def _devices(x) -> set:
    leaves = list(x[0]) + list(x[1].values())
    return {t.device.type for t in leaves if isinstance(t, torch.Tensor)}


def _kinds(report):
    return sorted((g.kind, g.size, g.blocks) for g in report.groups)


def test_a_meta_model_on_token_ids_traces_each_input_where_its_weights_are(tmp_path, monkeypatch):
    """The meta model analysed on real CPU token ids (as the engine does with ``--data``): the
    meta trace gets meta inputs, the twin CPU inputs; the constants (Falcon's multi-query split
    indexes) have their values and the report is the loaded model's on the same ids."""
    model, meta = _falcon(tmp_path)
    calls = []
    real = torch.export.export

    def spy(mod, args, kwargs=None, **kw):
        calls.append((next(mod.parameters()).device.type, _devices((args, kwargs or {}))))
        return real(mod, args, kwargs, **kw)
    monkeypatch.setattr(torch.export, "export", spy)
    built = symgraph.analyze(meta, IDS)
    assert calls[:2] == [("meta", {"meta"}), ("cpu", {"cpu"})]  # the meta trace, then its twin
    monkeypatch.setattr(torch.export, "export", real)
    consts = {k: v for k, v in built.exported_program.constants.items() if "lifted" in k}
    assert sorted(int(v) for v in consts.values()) == [-2, -1]
    assert _kinds(built) == _kinds(symgraph.analyze(model, IDS))
    assert all(t.device.type == "cpu" for t in IDS.values())  # the caller's ids are left where they were


def test_a_twin_that_fails_leaves_the_meta_trace(tmp_path, monkeypatch):
    """Whatever fails in the twin (building it or tracing it), the meta trace stands: the
    analysis goes on with the constants unknown (on meta), as without a twin."""
    _, meta = _falcon(tmp_path)

    def broken(*a, **kw):
        raise RuntimeError("Unhandled FakeTensor Device Propagation for aten.embedding.default")
    monkeypatch.setattr(trace_mod, "_fake_twin_trace", broken)
    ep, _, _ = trace_mod.trace(meta, IDS)
    consts = {k: v for k, v in ep.constants.items() if "lifted" in k}
    assert len(consts) == 2 and all(v.is_meta for v in consts.values())

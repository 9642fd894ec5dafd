"""REPAIR out of core (:mod:`symgraph.merging.repair_stream`): ``symgraph merge --repair`` runs in
the merge engine, its merged tensors equal the in-memory REPAIR's, every repaired channel ends
at its target, and the engine's tensors stay within the memory budget."""
from __future__ import annotations

import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from symgraph.cli.main import main as cli
from symgraph.errors import NeedsMemory
from symgraph.merging import repair_stream
from symgraph.merging.config import MergeConfig
from symgraph.merging.run import run_merge
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    for i in range(2):
        sizes = {k: v for k, v in SIZES.items() if request.param == "llama" or k != "kv_heads"}
        models.build(request.param, seed=i, **sizes).save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (40, 12), generator=g)}, str(d / "data.safetensors"))
    return d


_load, _rel = load, rel


def test_repair_out_of_core_equals_in_memory(pair, tmp_path, capsys):
    data = str(pair / "data.safetensors")
    out = tmp_path / "stream"
    assert cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(out), "--repair", "--data", data,
                "--memory-budget", "256KB"]) == 0
    assert "loaded in memory" not in capsys.readouterr().err  # out of core, not a silent load
    cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(tmp_path / "mem"), repair=True, data=data)
    assert run_merge(cfg, streaming=False, progress=False).mode == "in-memory"
    streamed, loaded = _load(out), _load(tmp_path / "mem")
    assert _rel(streamed, loaded) < 1e-5
    assert cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(tmp_path / "avg")]) == 0
    assert _rel(streamed, _load(tmp_path / "avg")) > 1e-3  # REPAIR changed the merge
    rec = {p: json.load(open(os.path.join(p, "symgraph_merge.json")))["repair"] for p in (out, tmp_path / "mem")}
    got, want = rec[out]["layers"], rec[tmp_path / "mem"]["layers"]
    # LLaMA: gate and up of 2 layers; GPT-2: c_fc of 2 layers
    assert [x["weight"] for x in got] == [x["weight"] for x in want] and len(got) == (4 if "llama" in str(pair) else 2)
    assert all(x["after"] < 1e-6 and x["before"] > 0.05 for x in got)  # each channel at its target
    assert got[0]["before"] == pytest.approx(want[0]["before"], rel=1e-5)  # the first wave: the same merge


def test_repair_holds_no_more_than_its_budget(pair, tmp_path):
    ids = load_file(str(pair / "data.safetensors"))["input_ids"]
    data = [{"input_ids": ids[i:i + 8]} for i in range(0, len(ids), 8)]
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], data=data, repair=True, memory_budget="256KB")
    job.align()
    os.makedirs(tmp_path / "o")
    job.write(str(tmp_path / "o"))
    assert 0 < job.ledger.peak <= 256 << 10
    assert job.ledger.now == 0
    llama = "llama" in str(pair)  # gate and up without biases; GPT-2's c_fc with one
    assert len(job.repair_report.layers) == (4 if llama else 2) and len(job.corrections) == 4


@pytest.mark.slow  # the aligned case runs by default, here and in tests/test_engine.py
def test_repair_without_alignment_equals_in_memory(pair, tmp_path):
    data = str(pair / "data.safetensors")
    outs = {}
    for streaming in (True, False):
        cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(tmp_path / str(streaming)),
                          repair=True, data=data, align="none")
        assert run_merge(cfg, streaming=streaming, progress=False).mode == ("streaming" if streaming else "in-memory")
        outs[streaming] = _load(tmp_path / str(streaming))
    assert _rel(outs[True], outs[False]) < 1e-5


def test_batchnorm_models_are_repaired_in_memory():
    """BatchNorm running statistics are recomputed by training-mode passes over a loaded merge."""
    job = types.SimpleNamespace(anchor=0, ckpts=[types.SimpleNamespace(model=torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))])
    with pytest.raises(NeedsMemory, match="BatchNorm"):
        repair_stream.check(job)
    job.ckpts[0].model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    repair_stream.check(job)

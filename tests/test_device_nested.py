"""Activation-aligned merges on another device (the ``fakegpu`` test device, on which an op
mixing its tensors with CPU tensors raises): a tied LLaMA pair whose attention is a head family
solved by nested matching (heads matched by the best inner alignment of each head pair: RoPE
rotations and value rotations observed on the data, the query heads sharing a key/value head
matched by weights). Out of core, the graphs run op by op on tensors read from the checkpoints:
on the device, so that the activation statistics are where the weight similarities they are
solved with are (they were taken on the CPU, and nested matching added the CPU's objectives to
the device's). Each merge equals the CPU's."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

import symgraph
from symgraph.cli.main import main as cli
from symgraph.core.ties import to_device
from symgraph.solve import nested_heads
from symgraph.testing import models
from symgraph.testing.device import MixedDevices, install

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("nested")
    for i in range(2):
        m = models.build("llama", seed=i, tie_word_embeddings=True, **SIZES)
        models.randomize_vectors(m, seed=10 + i).save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (12, 10), generator=g)}, str(d / "data.safetensors"))
    return d


def _merge(pair, out, device, *flags):
    assert cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(out), "--align", "activations",
                "--data", str(pair / "data.safetensors"), "--device", device, *flags]) == 0
    return load(out)


@pytest.mark.parametrize("flags", [(), pytest.param(("--refine", "2", "--memory-budget", "1MB"), marks=pytest.mark.slow)],
                         ids=["plain", "refine"])  # refine: 5 s
def test_out_of_core_activation_merge_on_a_device_equals_the_cpu(pair, tmp_path, flags, capsys):
    dev = install()
    cpu = _merge(pair, tmp_path / "cpu", "cpu", *flags)
    on_dev = _merge(pair, tmp_path / "dev", dev, *flags)
    assert "out of core" in capsys.readouterr().out  # the engine, not a load
    assert rel(on_dev, cpu) < 1e-5
    avg = load(_average(pair, tmp_path))
    assert rel(cpu, avg) > 1e-3  # the alignment moved B


def _average(pair, tmp_path):
    out = tmp_path / "avg"
    assert cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(out)]) == 0
    return out


def test_activation_statistics_out_of_core_are_on_the_device(pair, tmp_path, monkeypatch):
    """The out-of-core activation alignment on the device: every similarity nested matching
    gets is on the device (the statistics included), and its head matching and rotations
    equal the CPU's."""
    from symgraph.alignment import solve_unit
    seen: dict = {}

    def spy(S_inner, *a, **kw):
        seen.setdefault(device, set()).update(str(torch.as_tensor(s).device) for s in S_inner)
        return nested_heads(S_inner, *a, **kw)
    monkeypatch.setattr(solve_unit.S, "nested_heads", spy)
    dev = install()
    from symgraph.merging.streaming import StreamingMerge
    from safetensors.torch import load_file
    ids = load_file(str(pair / "data.safetensors"))["input_ids"]
    data = [{"input_ids": ids[i:i + 6]} for i in range(0, len(ids), 6)]
    els = {}
    for device in ("cpu", dev):
        job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], data=data, device=device, align="activations")
        els[device] = job.align()[1].elements
    assert seen == {"cpu": {"cpu"}, dev: {f"{dev}:0"}}
    assert els["cpu"].keys() == els[dev].keys()
    for k, e in els["cpu"].items():
        d = els[dev][k]
        a = e.dense() if hasattr(e, "dense") else e
        b = (d.dense() if hasattr(d, "dense") else d).to("cpu")
        assert torch.allclose(a.double(), b.double(), atol=1e-6), k


def test_nested_heads_on_a_device_equals_the_cpu():
    """Nested matching on the device: the outer scores and the inner rotations are computed
    there, and equal the CPU's; classes on two devices are a caller's error (the device
    raises, as CUDA would), not silently moved."""
    dev = install()
    g = torch.Generator().manual_seed(1)
    S = [torch.randn(3, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    pairs = [[(0, 1), (2, 3)], []]
    ref, ref_els = nested_heads(S, ["rope", "orthogonal"], pairs)
    out, els = nested_heads([s.to(dev) for s in S], ["rope", "orthogonal"], pairs)
    assert torch.equal(out.element.to("cpu").argmax(0), ref.element.argmax(0))
    for a, b in zip(els, ref_els):
        assert a.device.type == dev and torch.allclose(a.to("cpu"), b, atol=1e-10)
    with pytest.raises(MixedDevices):
        nested_heads([S[0], S[1].to(dev)], ["rope", "orthogonal"], pairs)


def test_in_memory_activation_alignment_on_a_device_equals_the_cpu(pair):
    """``symgraph.align(..., data=...)`` with the models and the batches on the device (the
    graphs run on the models' own tensors there) equals the CPU's alignment."""
    dev = install()
    ms = [models.randomize_vectors(models.build("llama", seed=i, tie_word_embeddings=True, **SIZES), seed=10 + i)
          for i in range(2)]
    from safetensors.torch import load_file
    ids = load_file(str(pair / "data.safetensors"))["input_ids"]
    data = [{"input_ids": ids[i:i + 6]} for i in range(0, len(ids), 6)]
    ref = symgraph.align(ms[0], ms[1], data=data)
    assert ref.report_a.folds == []  # the head tied to the embedding: no norm gain folds
    on = [to_device(copy.deepcopy(m), dev) for m in ms]  # (a plain .to unties them on this device)
    al = symgraph.align(on[0], on[1], data=[{k: v.to(dev) for k, v in b.items()} for b in data])
    sa, sb = ref.apply(ms[1]).state_dict(), al.apply(on[1]).state_dict()
    assert max(float((sa[k] - sb[k].to("cpu")).abs().max() / sa[k].abs().max().clamp_min(1e-12)) for k in sa) < 1e-5

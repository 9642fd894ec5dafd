"""The one merge engine (:mod:`symgraph.merging.streaming`): every method whose statistics it
can take runs out of core through ``symgraph merge`` and equals the in-memory merge of the same
pair; the bytes it holds stay within ``--memory-budget``; a merge on another device (the
``fakegpu`` test device) equals the CPU's; what cannot stream says so."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from symgraph.cli.main import main as cli
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    for i in range(2):
        models.build("llama", seed=i, tie_word_embeddings=True, **SIZES).save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (40, 12), generator=g)}, str(d / "data.safetensors"))
    return d


_load, _rel = load, rel


#: Every merge the engine runs, as (YAML options, its command-line flags, whether it reads data).
#: Learned matching (refine) runs here too: tests/test_engine_refine.py (its elements' optimiser
#: state needs more than this file's 128KB budget).
METHODS = {
    "average": ({}, [], False),
    "fisher": ({"method": "fisher"}, ["--method", "fisher"], True),
    "regmean": ({"method": "regmean"}, ["--method", "regmean"], True),
    "repair": ({"repair": True}, ["--repair"], True),
    "circuits": ({"attention": "circuits"}, ["--attention", "circuits"], False),
    "untie": ({"untie": True}, ["--untie"], False),
    "full_groups": ({"full_groups": True}, ["--full-groups"], False),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_out_of_core_equals_in_memory(pair, tmp_path, method, capsys):
    """``symgraph merge`` runs every method out of core (no note that the models were loaded),
    and its merged tensors equal the in-memory merge's (``streaming=False``) of the same pair;
    each changes the merge (it is not the plain average)."""
    options, flags, reads = METHODS[method]
    data = ["--data", str(pair / "data.safetensors")] if reads else []
    out = tmp_path / "stream"
    rc = cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(out), *flags,
              "--memory-budget", "128KB", *data])
    assert rc == 0
    assert "loaded in memory" not in capsys.readouterr().err  # out of core, not a silent load
    cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(tmp_path / "mem"), **options,
                      data=str(pair / "data.safetensors") if data else None)
    assert run_merge(cfg, streaming=False, progress=False).mode == "in-memory"
    streamed, loaded = _load(out), _load(tmp_path / "mem")
    assert _rel(streamed, loaded) < 1e-5
    # untying alone leaves a tied pair's average as it was; on this tied pair no head's GL fit brings
    # B closer to A (tests/test_engine_full_groups.py: an untied pair and a transformed copy it recovers)
    if method == "circuits":  # the attention projections widened, every other tensor the average
        avg = _load(_average(pair, tmp_path))
        assert sum(v.shape != avg[k].shape for k, v in streamed.items()) == 4 * SIZES["layers"]
    elif method not in ("average", "untie", "full_groups"):
        assert _rel(streamed, _load(_average(pair, tmp_path))) > 1e-3
    else:
        assert ("lm_head.weight" in streamed) == (method == "untie")  # the head written as its own tensor


def _average(pair, tmp_path):
    out = tmp_path / "avg"
    if not out.exists():
        assert cli(["merge", str(pair / "m0"), str(pair / "m1"), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("method", ["average", "regmean", "fisher"])
@pytest.mark.slow
def test_the_engine_holds_no_more_than_its_budget(pair, tmp_path, method):
    """The bytes the engine holds (caches, a pass of Grams, a group's working copies, the
    statistics it reads back) stay within the budget, and a smaller budget (more slices,
    more passes) gives the same merge. (A group no slice can split, such as a norm fold's
    readers, is held whole: a budget below the largest one, here 37 to 82 kB by method, is
    refused before alignment: tests/test_budget_floor.py.)"""
    data = _data(pair) if method != "average" else None
    tensors = {}
    for budget in ("128KB", "1MB"):
        job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], method=method, data=data,
                             memory_budget=budget)
        job.align()
        os.makedirs(tmp_path / budget)
        job.write(str(tmp_path / budget))
        assert 0 < job.resources.ledger.peak <= {"128KB": 128 << 10, "1MB": 1 << 20}[budget]
        assert job.resources.ledger.now == 0  # everything it held was let go
        tensors[budget] = _load(tmp_path / budget)
    assert _rel(tensors["128KB"], tensors["1MB"]) < 1e-6


def _data(pair):
    ids = load_file(str(pair / "data.safetensors"))["input_ids"]
    return [{"input_ids": ids[i:i + 8]} for i in range(0, len(ids), 8)]


def test_grams_taken_in_passes_equal_one_pass(pair, tmp_path, monkeypatch):
    """RegMean's Grams in several passes over the data (each batch's run paused where a pass
    ends) are the Grams of one pass."""
    from symgraph.merging.engine import sums as statistics
    passes = []
    real = statistics._passes
    monkeypatch.setattr(statistics, "_passes", lambda *a: passes.append(real(*a)) or passes[-1])
    grams = {}
    for budget in (1 << 10, 1 << 30):
        job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], method="regmean", data=_data(pair))
        job.resources.stats_bytes = budget
        job.align()
        from symgraph.merging.engine.statistics import StatisticsContext, take
        from symgraph.merging.engine.sums import Spill
        job.spill = Spill(str(tmp_path))
        st = take(job.how.statistic, StatisticsContext.of(job), 1)
        grams[budget] = {k: st[k] for k in st}
        job.spill.close()
    assert len(passes[0]) > 2 and len(passes[1]) == 1
    for k, g in grams[1 << 30].items():
        assert torch.allclose(grams[1 << 10][k], g, rtol=1e-12, atol=1e-9), k


@pytest.mark.parametrize("method,align", [("average", "weights"), ("regmean", "none"), ("fisher", "none")])
@pytest.mark.slow
def test_a_merge_on_another_device_equals_the_cpu(pair, tmp_path, method, align):
    """The engine on the ``fakegpu`` device: each method's merge equals the CPU's (RegMean and
    Fisher unaligned: the device's weight matching solves its rotations in float32 on another
    route, equal to the CPU's to about 5e-6, which RegMean's solve amplifies to 1e-5)."""
    from symgraph.testing.device import install
    dev = install()
    data = str(pair / "data.safetensors") if method != "average" else None
    outs = {}
    for device in ("cpu", dev):
        cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(tmp_path / device),
                          method=method, data=data, device=device, align=align)
        assert run_merge(cfg, streaming=True, progress=False).mode == "streaming"
        outs[device] = _load(tmp_path / device)
    assert _rel(outs[dev], outs["cpu"]) < 1e-5


def test_what_cannot_stream_says_so(tmp_path):
    """Models that are not local checkpoint directories (demo names, hub ids) are loaded:
    streaming=True refuses them, saying why."""
    cfg = MergeConfig(models=["tiny-llama", "tiny-llama"], out=str(tmp_path / "o"))
    from symgraph.errors import InputError
    with pytest.raises(InputError, match="cannot run out of core: not every model is a local checkpoint directory"):
        run_merge(cfg, streaming=True, progress=False)


def test_a_merge_that_loads_the_models_says_why(tmp_path, capsys):
    cfg = MergeConfig(models=["tiny-llama", "tiny-llama"], out=str(tmp_path / "o"))
    assert run_merge(cfg, progress=False).mode == "in-memory"
    err = capsys.readouterr().err
    assert "note: the models are loaded in memory for this merge: not every model is a local checkpoint" in err


def test_the_spill_deletes_only_what_it_wrote(tmp_path):
    """Statistics spilled beside the output are removed with their directory, but a file that
    something else put there stays (and so does the directory)."""
    from symgraph.merging.engine.sums import Spill
    spill = Spill(str(tmp_path))
    spill.put({"g": torch.ones(3)})
    assert torch.equal(spill.get("g"), torch.ones(3))
    (tmp_path / os.path.basename(spill.dir) / "theirs.txt").write_text("keep")
    spill.close()
    assert [p.name for p in (tmp_path / os.path.basename(spill.dir)).iterdir()] == ["theirs.txt"]
    other = Spill(str(tmp_path))
    other.put({"g": torch.ones(1)})
    other.close()
    assert not os.path.exists(other.dir)


@pytest.mark.parametrize("method", ["fisher", "regmean"])
def test_statistics_of_a_group_merged_in_slices(pair, tmp_path, monkeypatch, method):
    """A group over the chunk size is merged in slices: Fisher's squared gradients (a tensor's
    own shape) are read from the store slice by slice, never whole; RegMean's Grams (over a
    weight's inputs: square like a square weight, which is sliced along its outputs) whole.
    The merge is the whole computation's, byte for byte."""
    from symgraph.merging.engine import sums as statistics
    reads: list = []
    real = statistics.Spill.get

    def spy(self, key, part=None, shape=None):
        t = real(self, key, part, shape)
        reads.append((part is not None, shape is not None and tuple(t.shape) != tuple(shape)))
        return t
    monkeypatch.setattr(statistics.Spill, "get", spy)
    outs = {}
    for chunk in (1 << 30, 1000):
        job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], method=method, data=_data(pair), align="none")
        job.align()
        job.resources.chunk_bytes = chunk
        reads.clear()
        os.makedirs(tmp_path / str(chunk))
        job.write(str(tmp_path / str(chunk)))
        outs[chunk] = _load(tmp_path / str(chunk))
    asked, sliced = sum(a for a, _ in reads), sum(s for _, s in reads)
    if method == "fisher":
        assert asked > 0 and sliced == asked  # every sliced group's statistic read as its slice
    else:
        assert asked == 0  # the Grams whole
    for k, v in outs[1 << 30].items():
        assert torch.equal(v, outs[1000][k]), k

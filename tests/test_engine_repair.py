"""REPAIR out of core (:mod:`symgraph.merging.repair_stream`): ``symgraph merge --repair`` runs in
the merge engine, its merged tensors equal the in-memory REPAIR's, every repaired channel ends
at its target, and the engine's tensors stay within the memory budget."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import symgraph
from symgraph.cli.main import main as cli
from symgraph.errors import InputError, NeedsMemory
from symgraph.merging import repair_stream
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

from repair_helpers import ReadsStatistics, population_gap

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


@pytest.mark.slow
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
    assert 0 < job.resources.ledger.peak <= 256 << 10
    assert job.resources.ledger.now == 0
    llama = "llama" in str(pair)  # gate and up without biases; GPT-2's c_fc with one
    assert len(job.repair_report.layers) == (4 if llama else 2) and len(job.transforms.corrections) == 4


def test_repair_reads_the_merge_through_the_context_the_engine_builds(pair):
    """``RepairContext.of`` is the one reader of the engine: its ``merged`` view computes a unit by
    the executor (here the plain average, unaligned), its corrections reach the engine's plan
    (the executor that writes applies them) and the view's cache alike; ``parent(i)`` is model
    ``i`` in the anchor's basis; a tied or unmerged graph input is the anchor's own."""
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.merging.engine.measuring import RepairContext
    ids = load_file(str(pair / "data.safetensors"))["input_ids"]
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], data=[{"input_ids": ids[:8]}], repair=True,
                         align="none", weights=[0.25, 0.75])
    job.align()
    ctx = RepairContext.of(job)
    assert ctx.weights == (0.25, 0.75) and ctx.graph_report is job.graph_report and ctx.data == job.data
    a, b = (Checkpoint(str(pair / f"m{i}")) for i in range(2))
    name = next(n for n in job.graph_report.parameters if n.endswith(("mlp.down_proj.weight", "mlp.c_proj.weight")))
    assert torch.equal(ctx.merged.fetch(name), (0.25 * a.get(name) + 0.75 * b.get(name)).to(a.get(name).dtype))
    assert torch.equal(ctx.parent(1).fetch(name), b.get(name))  # no alignment: B as stored
    ctx.merged.correct({name: lambda t: 2 * t})
    doubled = 2 * (0.25 * a.get(name) + 0.75 * b.get(name))
    assert torch.equal(ctx.merged.fetch(name), doubled) and name in job.transforms.corrections
    assert torch.equal(job.executor().merged((name,))[name], doubled)  # what the engine writes
    ctx.merged.clear()


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



def test_batchnorm_statistics_read_outside_a_batchnorm_op_are_refused():
    """REPAIR resets the statistics of the graph's batch-norm ops; a BatchNorm module whose
    statistics the graph reads otherwise is refused in one line (an InputError, not a load into
    memory), in memory and out of core alike; one the graph never reads is merged as it is."""
    x = torch.randn(5, 3)
    data = [(torch.randn(6, 3),)]
    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    repair_stream.check(plain, symgraph.analyze(plain, (x,)))
    model = ReadsStatistics()
    for refuse in (lambda: repair_stream.check(model, symgraph.analyze(model, (x,))),
                   lambda: symgraph.merge([model, ReadsStatistics()], data=data, align=None, repair=True)):
        with pytest.raises(InputError, match="reads 'bn.running_mean' outside a batch-norm op") as e:
            refuse()
        assert not isinstance(e.value, NeedsMemory) and "\n" not in str(e.value)
    assert symgraph.merge([model, ReadsStatistics()], data=data, align=None).repair is None  # no REPAIR: merged


@pytest.mark.parametrize("align", ["weights", "none"])
def test_the_anchor_is_analysed_once_before_any_work(monkeypatch, align):
    """``StreamingMerge.align`` analyses the anchor once, and REPAIR's BatchNorm check, the
    budget's floor and the alignment read that analysis (REPAIR's check of a BatchNorm net
    traced it a second time before)."""
    from symgraph.checkpoints.memory import ModelCheckpoint
    from symgraph.report import api
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2)).eval() for _ in range(2)]
    traced, analyze = [], api.analyze
    monkeypatch.setattr(api, "analyze", lambda *a, **k: traced.append(a[0]) or analyze(*a, **k))
    job = StreamingMerge([ModelCheckpoint(m, f"model {i}") for i, m in enumerate(nets)], align=align,
                         data=[(torch.randn(6, 3),)], repair=True, memory_budget="1MB")
    job.align()
    assert traced == [nets[0]] and job.graph_report is not None
    assert (job.alignments[1] is not None) == (align == "weights")


@pytest.mark.parametrize("cls", ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "functional"])
@pytest.mark.parametrize("training", [False, True])
def test_every_batchnorm_module_normalises_through_a_batchnorm_op(cls, training):
    """Why the refusal above never meets a real model: every ``torch.nn`` BatchNorm module, and
    ``F.batch_norm`` on a module's statistics, trace to a batch-norm op that reads them (in train
    mode too: the analysis traces in eval mode), and no class of transformers or diffusers
    subclasses a BatchNorm module (their frozen BatchNorms are not BatchNorm modules and are not
    reset)."""
    shape = {"BatchNorm1d": (2, 3), "BatchNorm3d": (2, 3, 3, 3, 3)}.get(cls, (2, 3, 3, 3))
    bn = getattr(torch.nn, cls if cls != "functional" else "BatchNorm2d")(4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(3, 4), bn

        def forward(self, x):
            h = self.lin(x).movedim(-1, 1)
            if cls == "functional":
                return torch.nn.functional.batch_norm(h, self.bn.running_mean, self.bn.running_var, eps=1e-3)
            return self.bn(h)
    net = Net().train(training)
    rep = symgraph.analyze(net, (torch.randn(*shape),))
    assert list(repair_stream.batchnorm_nodes(rep).values()) == [("bn.running_mean", "bn.running_var")]
    repair_stream.check(net, rep)
    assert net.training == training


def test_no_model_of_transformers_or_diffusers_subclasses_a_batchnorm_module():
    import importlib.util
    import pathlib
    import re
    subclass = re.compile(r"^\s*class\s+\w+\s*\([^)]*\b(?:(?:Lazy)?BatchNorm[123]d|SyncBatchNorm|_BatchNorm|_NormBase)\b",
                          re.M)
    assert subclass.search("class MyNorm(nn.BatchNorm2d):") and not subclass.search("class F(nn.Module):")
    found = {}
    for package in ("transformers", "diffusers"):
        root = pathlib.Path(importlib.util.find_spec(package).origin).parent
        files = list(root.rglob("*.py"))
        assert len(files) > 500, package
        found[package] = [str(p) for p in files if subclass.search(p.read_text(errors="replace"))]
    assert found == {"transformers": [], "diffusers": []}


def test_a_batchnorm_module_the_forward_never_calls_is_not_refused():
    """Flux 2's VAE holds a BatchNorm of its latents that only its pipelines read: the model's
    graph never reads it, so REPAIR neither refuses nor resets it."""
    from diffusers import AutoencoderKLFlux2
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                             norm_num_groups=4, sample_size=16, mid_block_add_attention=False).eval()
    assert [n for n, m in vae.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] == ["bn"]
    rep = symgraph.analyze(vae, (torch.randn(1, 3, 16, 16),))
    assert repair_stream.batchnorm_nodes(rep) == {}
    sig, graph = rep.exported_program.graph_signature, rep.exported_program.graph
    read = {sig.inputs_to_buffers[x.name] for x in graph.nodes
            if x.op == "placeholder" and x.users and x.name in sig.inputs_to_buffers}
    assert not {"bn.running_mean", "bn.running_var"} & read
    repair_stream.check(vae, rep)


@pytest.fixture(scope="module")
def regnets(tmp_path_factory):
    """Two RegNets (BatchNorm after every conv, and channels REPAIR renormalises) with random
    running statistics, and images."""
    from transformers import RegNetConfig, RegNetForImageClassification
    d = tmp_path_factory.mktemp("regnet")
    cfg = RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4,
                       num_labels=5)
    for i in range(2):
        torch.manual_seed(i)
        m = RegNetForImageClassification(cfg).eval()
        with torch.no_grad():
            for name, buf in m.named_buffers():
                if name.endswith("running_mean"):
                    buf.normal_()
                elif name.endswith("running_var"):
                    buf.uniform_(0.5, 2.0)
        m.save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"pixel_values": torch.randn(40, 3, 32, 32, generator=g)}, str(d / "data.safetensors"))
    return d


@pytest.mark.parametrize("align", ["weights", pytest.param("none", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_batchnorm_models_are_repaired_out_of_core(regnets, tmp_path, align, capsys):
    """``symgraph merge --repair`` on BatchNorm checkpoints runs out of core (every BatchNorm's
    running statistics reset on the data in the same pass as the renormalised channels, each
    layer measured with every one before it final) and agrees with ``symgraph.merge``'s REPAIR
    (the same step over the models in memory); each BatchNorm layer of the merge then holds its
    input's population statistics (measured by hooks on the written model), every renormalised
    channel is at its target, and the statistics differ from the unrepaired merge's."""
    from transformers import RegNetForImageClassification
    from symgraph.merging.repair import batchnorm_layers
    data, models = str(regnets / "data.safetensors"), [str(regnets / "m0"), str(regnets / "m1")]
    out = tmp_path / "stream"
    assert cli(["merge", *models, "--out", str(out), "--repair", "--data", data, "--align", align]) == 0
    assert "loaded in memory" not in capsys.readouterr().err
    meta = json.load(open(out / "symgraph_merge.json"))
    assert meta["mode"] == "streaming"
    merged = RegNetForImageClassification.from_pretrained(str(out)).eval()
    names = batchnorm_layers(merged)
    assert len(meta["repair"]["batchnorm"]) == len(names) == 9 and len(meta["repair"]["layers"]) > 0
    assert all(r["std_ratio"] < 0.9 for r in meta["repair"]["batchnorm"])  # the merge's collapse, reported
    cfg = MergeConfig(models=models, out=str(tmp_path / "mem"), repair=True, data=data, align=align)
    assert run_merge(cfg, streaming=False, progress=False).mode == "in-memory"
    streamed, loaded = _load(out), _load(tmp_path / "mem")
    assert _rel(streamed, loaded) < 1e-4
    assert max(x["after"] for x in meta["repair"]["layers"]) < 1e-6
    images = load_file(data)["pixel_values"]
    assert population_gap(merged, [(images[i:i + 8],) for i in range(0, 40, 8)]) < 1e-5
    before = {k for k in merged.state_dict() if "running_" in k}
    plain = tmp_path / "plain"
    assert cli(["merge", *models, "--out", str(plain), "--align", align]) == 0
    unrepaired = _load(plain)
    assert min(float((streamed[k] - unrepaired[k]).abs().max()) for k in before) > 1e-3

"""Out-of-core merging (:mod:`symgraph.merging.streaming`): sharded bf16 checkpoints in, sharded bf16
checkpoint out, equal to the in-memory merge with the same alignment; refusals before work."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import symgraph
from symgraph.merging.streaming import Checkpoint, KeysDiffer, StreamingMerge
from symgraph import merge_checkpoints

from conftest import build_hf, cli


def _pair(tmp_path, name="llama", dtype=torch.bfloat16, shard="10KB"):
    """Two checkpoints of one architecture in ``dtype``: A, and B = A under a random element
    plus noise (so the alignment has something to find and the merge is not A)."""
    a, _ = build_hf(name, 0)
    b = symgraph.transform(a, symgraph.analyze(a).random_transform(seed=3))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in b.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    for m, d in ((a, "a"), (b, "b")):
        m.to(dtype).save_pretrained(tmp_path / d, max_shard_size=shard)
    return str(tmp_path / "a"), str(tmp_path / "b")


def _tensors(path):
    out = {}
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sharded_bf16_merge_equals_in_memory(tmp_path, name):
    pa, pb = _pair(tmp_path, name)
    assert os.path.exists(os.path.join(pa, "model.safetensors.index.json"))  # the inputs are sharded
    job = merge_checkpoints([pa, pb], str(tmp_path / "out"), max_shard_size="8KB")
    out = _tensors(str(tmp_path / "out"))
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")  # sharded output
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(_tensors(pa)) == set(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    # the in-memory merge with the same alignment, from the models from_pretrained loads
    A, B = (AutoModelForCausalLM.from_pretrained(p) for p in (pa, pb))
    al = job.alignments[1]
    assert al.report_b.folds == al.report_a.folds
    mem = symgraph.merge([A, B]).model
    expect = {k: v.detach() for k, v in mem.state_dict().items()}
    for k, t in out.items():
        e = expect[k].float()
        # bf16 precision: one rounding of values accumulated in float32 vs float64
        assert (t.float() - e).abs().max() <= 2 ** -7 * e.abs().max() + 1e-6, k
    # and the merge is neither input: the alignment mattered
    diff = {k: (out[k].float() - v.float()).abs().max() for k, v in _tensors(pa).items()}
    assert max(diff.values()) > 1e-3
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert merged.dtype == torch.bfloat16


def test_alignment_recovers_a_permuted_copy(tmp_path):
    """B = A under a random element (with a dense residual rotation): streaming weight
    matching finds it, and the merge is A to bf16 rounding."""
    a, _ = build_hf("llama", 0)
    a = a.double()
    b = symgraph.transform(a, symgraph.analyze(a).random_transform(seed=5, orthogonal=True))
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    job = merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
    assert any(g.kind == "orthogonal" for g in job.report.groups)
    out, ref = _tensors(str(tmp_path / "out")), _tensors(str(tmp_path / "a"))
    assert max(float((out[k] - ref[k]).abs().max()) for k in ref) < 1e-9
    assert all(out[k].dtype == torch.float64 for k in out)  # dtype as it came in


def test_align_none_is_the_plain_average(tmp_path):
    pa, pb = _pair(tmp_path, "gpt2", dtype=torch.float32)
    merge_checkpoints([pa, pb], str(tmp_path / "out"), align="none", weights=[3, 1])
    out, ta, tb = _tensors(str(tmp_path / "out")), _tensors(pa), _tensors(pb)
    for k in ta:
        assert torch.allclose(out[k], 0.75 * ta[k] + 0.25 * tb[k], atol=1e-7), k


def test_checkpoint_refuses_before_reading(tmp_path):
    pa, _ = _pair(tmp_path, "llama", dtype=torch.float32, shard="10MB")
    ck = Checkpoint(pa)
    assert ck.dtype == torch.float32 and all(p.is_meta for p in ck.model.parameters())
    # an extra tensor the model does not have
    from safetensors.torch import save_file
    ts = _tensors(pa)
    save_file(ts | {"extra.weight": torch.zeros(2)}, os.path.join(pa, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeysDiffer, match="extra.weight"):
        Checkpoint(pa)
    missing = {k: v for k, v in ts.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, os.path.join(pa, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeysDiffer, match="up_proj"):
        Checkpoint(pa)
    resized = ts | {"model.norm.weight": torch.ones(7)}
    save_file(resized, os.path.join(pa, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(symgraph.InputError, match="model.norm.weight"):
        Checkpoint(pa)


@pytest.mark.parametrize("align", ["weights", "none"])
def test_nan_is_refused_and_nothing_is_written(tmp_path, align):
    pa, pb = _pair(tmp_path, "llama", dtype=torch.float32, shard="10MB")
    ts = _tensors(pb)
    ts["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    from safetensors.torch import save_file
    save_file(ts, os.path.join(pb, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(symgraph.InputError, match=r"/b' has 1 NaN/inf values in tensor 'model.layers.0.mlp.down_proj"):
        merge_checkpoints([pa, pb], str(tmp_path / "out"), align=align)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


@pytest.mark.slow
def test_cli_streams_plain_averages(tmp_path):
    pa, pb = _pair(tmp_path, "llama")
    r = cli("merge", pa, pb, "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    meta = json.load(open(tmp_path / "out" / "symgraph_merge.json"))
    assert meta["mode"] == "streaming" and meta["dtype"] == "bfloat16"
    assert len(meta["alignments"][0]["groups"]) == len(symgraph.analyze(build_hf("llama", 0)[0]).groups)
    job = StreamingMerge([pa, pb])
    job.align()
    for k, t in _tensors(str(tmp_path / "out")).items():
        assert t.dtype == torch.bfloat16, k


def test_batchnorm_running_statistics_move_and_average(tmp_path):
    """A conv net with BatchNorm (RegNet): the running statistics move with their channels
    and are averaged like the weights, out of core as in memory."""
    from transformers import RegNetConfig, RegNetForImageClassification
    cfg = RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4,
                       num_labels=5)
    torch.manual_seed(0)
    a = RegNetForImageClassification(cfg).eval()
    with torch.no_grad():
        for name, buf in a.named_buffers():
            if "running_mean" in name:
                buf.normal_()
            elif "running_var" in name:
                buf.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 32, 32)
    report = symgraph.analyze(a, {"pixel_values": x})
    assert report.buffers  # the running statistics are moved by classes
    b = symgraph.transform(a, report.random_transform(seed=1, orthogonal=True))
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    ta, tb = _tensors(str(tmp_path / "a")), _tensors(str(tmp_path / "b"))
    moved = [k for k in report.buffers if not torch.equal(ta[k], tb[k])]
    assert moved  # B's statistics are in another channel order
    merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
    out = _tensors(str(tmp_path / "out"))
    assert max(float((out[k].double() - ta[k].double()).abs().max()) for k in ta) < 1e-5
    merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "none"), align="none")
    out = _tensors(str(tmp_path / "none"))
    for k in moved:
        assert torch.allclose(out[k], 0.5 * ta[k] + 0.5 * tb[k], atol=1e-6), k


@pytest.mark.parametrize("name,stream", [("llama", True), ("llama", False), ("gpt2", True)])
def test_merging_in_slices_is_bit_identical(tmp_path, monkeypatch, name, stream):
    """Groups over the engine's chunk size are merged in slices along an axis no map and no fold acts
    on (vocabulary, positions), streamed to the shard row block by row block or assembled
    (``stream=False``): the same bytes as the whole computation, dense residual maps included."""
    pa, pb = _pair(tmp_path, name)
    job = StreamingMerge([pa, pb], max_shard_size="8KB")
    job.align()
    os.makedirs(tmp_path / "whole")
    job.write(str(tmp_path / "whole"))
    from symgraph.merging.engine import slicing
    splits, split = [], slicing.split

    def spy(job, names):
        s = split(job, names)
        s = s if s is None or stream else s[:4] + (None,)
        splits.append(s)
        return s
    monkeypatch.setattr(slicing, "split", spy)
    job.resources.chunk_bytes = 1000  # what a memory budget of about 6 KB gives two models
    os.makedirs(tmp_path / "sliced")
    job.write(str(tmp_path / "sliced"))
    done = [s for s in splits if s is not None]
    assert done and all(size > step for _, _, size, step, _ in done)  # computed in several slices
    assert any(streamed for *_, streamed in done) == stream
    a, b = _tensors(str(tmp_path / "whole")), _tensors(str(tmp_path / "sliced"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _batches(vocab=32, n=3, rows=4, seq=16):
    return [{"input_ids": torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(i))}
            for i in range(n)]


@pytest.mark.parametrize("name,dtype,passes", [("llama", torch.float32, False), ("gpt2", torch.float32, True),
                                               ("llama", torch.float32, True), ("llama", torch.bfloat16, False)])
@pytest.mark.slow
def test_activation_alignment_out_of_core_equals_in_memory(tmp_path, monkeypatch, name, dtype, passes):
    """Activation statistics streamed op by op from the checkpoints (graphs traced on meta)
    give the in-memory alignment of the loaded models, element for element, and the same merge;
    also when the statistics are taken class by class in passes (``passes``: a 1-byte budget),
    each class solved and its statistics dropped as its pass ends."""
    import symgraph.alignment.activations as acts
    import symgraph.merging.engine.slicing as slicing
    pa, pb = _pair(tmp_path, name, dtype=dtype)
    data = _batches()
    seen = []
    if passes:
        monkeypatch.setattr(slicing, "STATS_BYTES", 1)
        run = acts.activation_similarity

        def spy(*a, on_done=None, **kw):
            def done(ids, stats):
                # held before this pass's solve
                seen.append((set(ids), {i for i, s in stats.items() if s.sab is not None}))
                on_done(ids, stats)
            return run(*a, on_done=done if on_done else None, **kw)
        monkeypatch.setattr("symgraph.alignment.driver.activation_similarity", spy)
        steppers, ops = [], []  # every op of each graph runs once per batch: passes resume
        init, run_node = acts.Stepper.__init__, acts.Stepper.run_node
        monkeypatch.setattr(acts.Stepper, "__init__", lambda self, gm, *a, **k: (
            steppers.append(len(gm.graph.nodes)), init(self, gm, *a, **k))[1])
        monkeypatch.setattr(acts.Stepper, "run_node", lambda self, n: (ops.append(1), run_node(self, n))[1])
    job = merge_checkpoints([pa, pb], str(tmp_path / "out"), align="activations", data=data)
    if passes:
        made, ran = list(steppers), len(ops)  # the out-of-core run's only
    A, B = (AutoModelForCausalLM.from_pretrained(p) for p in (pa, pb))
    al, streamed = symgraph.align(A, B, data=data), job.alignments[1]
    assert streamed.similarity == al.similarity == "activations"
    n_perm = 0
    for gid, e in al.elements.items():
        s = streamed.elements[gid]
        if isinstance(e, symgraph.core.elements.Perm):
            assert torch.equal(e.index, s.index), gid
            n_perm += 1
        else:
            assert (e.double() - s.double()).abs().max() < 1e-5, gid
    assert n_perm >= 2
    if passes:  # one pass per class; the classes solved alone (residual, MLP) are dropped as their
        # pass ends; besides its own, a pass holds only a class observed from before it to after
        # it (the residual stream); head families wait for all their members
        from symgraph.alignment.schedule import units
        singles = {u.outer.id for u in units(al.report_a) if u.kind == "single"}
        assert len(seen) == len(al.elements)
        assert len(set().union(*((held & singles) - ids for ids, held in seen))) == 1
        # one Stepper per model and batch, resumed pass after pass: no op runs twice
        assert len(made) == 2 * len(data) and 0 < ran <= sum(made)
    mem = {k: v.detach() for k, v in symgraph.merge([A, B], align="activations", data=data).model.state_dict().items()}
    for k, t in _tensors(str(tmp_path / "out")).items():
        assert t.dtype == dtype, k
        e = mem[k].float()
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert (t.float() - e).abs().max() <= tol * e.abs().max() + 1e-6, k


def test_out_of_core_graph_holds_one_op_s_weights(tmp_path):
    """Running a graph traced on meta from a checkpoint reads each weight when an op takes it
    and drops it after: at no time are more than a few weights alive, out of the model's many."""
    import weakref
    from symgraph.alignment.activations import Stepper, flatten_for as _flatten_for, on_device
    from symgraph.alignment.checks import batch_inputs
    a, _ = build_hf("llama", 0)
    a.save_pretrained(tmp_path / "a")
    ckpt = Checkpoint(str(tmp_path / "a"))
    report = symgraph.analyze(ckpt.model, _batches()[0])
    gm = on_device(report.exported_program.module(), "cpu")
    alive, peak, reads = [], [0], [0]

    def fetch(name):
        t = ckpt.fetch(name)
        alive.append(weakref.ref(t))
        peak[0] = max(peak[0], sum(r() is not None for r in alive))
        reads[0] += 1
        return t
    x = _batches()[0]
    names = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    out = dict(Stepper(gm, fetch).steps(_flatten_for(gm, *batch_inputs(report, x, 0)), names))
    n_weights = len(list(a.named_parameters()))
    assert reads[0] >= n_weights and n_weights >= 20
    assert peak[0] <= 3, peak[0]
    # and it computes the model: the last op's output is the loaded model's logits
    logits = a(**x, use_cache=False).logits
    assert any(v.shape == logits.shape and torch.allclose(v, logits, atol=1e-5) for v in out.values())


@pytest.mark.slow  # the default suite took 747 s at 29a92d8 (budget 600 s); tests/test_engine.py keeps activation alignment out of core
def test_cli_streams_activation_alignment(tmp_path):
    pa, pb = _pair(tmp_path, "llama")
    from safetensors.torch import save_file
    save_file({"input_ids": torch.cat([b["input_ids"] for b in _batches(n=8)])}, str(tmp_path / "d.safetensors"))
    r = cli("merge", pa, pb, "--out", str(tmp_path / "out"), "--align", "activations",
            "--data", str(tmp_path / "d.safetensors"))
    assert r.returncode == 0, r.stderr
    meta = json.load(open(tmp_path / "out" / "symgraph_merge.json"))
    assert meta["mode"] == "streaming" and meta["options"]["align"] == "activations"
    assert meta["options"]["data"]


def test_streaming_activation_options_are_checked(tmp_path):
    pa, pb = _pair(tmp_path, "llama")
    with pytest.raises(symgraph.errors.InputError, match="needs data"):
        StreamingMerge([pa, pb], align="activations")
    with pytest.raises(symgraph.errors.InputError, match="used by align='activations' or a method that takes statistics"):
        StreamingMerge([pa, pb], align="weights", data=_batches())

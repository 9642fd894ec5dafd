"""Device and dtype follow the model: outputs in the inputs' dtype, merges accumulated in
float32, nothing created on the default device where the model's tensors live elsewhere, and
(marked ``gpu``, run on a CUDA machine) the whole pipeline on a GPU."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.core.elements import Perm

from conftest import build_hf


def _pair(dtype):
    a, _ = build_hf("llama", 0)
    b, _ = build_hf("llama", 1)
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_keep_the_dtype(dtype):
    a, b = _pair(dtype)
    ra = symgraph.analyze(a)
    moved = symgraph.transform(a, ra.random_transform(seed=0))
    al = symgraph.align(a, b, report_a=ra)
    b_in_a = al.apply(b)
    res = symgraph.merge([a, b])
    for m in (moved, b_in_a, res.model):
        assert {p.dtype for p in m.parameters()} == {dtype}
        assert {p.device.type for p in m.parameters()} == {"cpu"}
    # the merge engine carries B in float32 and rounds once: (A + B aligned) / 2, with B's
    # moved values never rounded to the 16-bit dtype on the way (by the merge's own alignment:
    # the engine solves rotations in float32, symgraph.align in float64)
    from symgraph.transform.apply import move
    own, mal = {k: v.detach() for k, v in b.named_parameters()}, res.alignments[1]
    assert mal.elements.keys() == al.elements.keys()
    moved = own | move(mal.report_b, mal.elements, own, mal.gauge, dtype=torch.float32)
    for k, p in res.model.named_parameters():
        want = (0.5 * a.get_parameter(k).float() + 0.5 * moved[k].float()).to(dtype)
        assert torch.equal(p.detach(), want), k
    assert all(p.dtype == dtype for p in a.parameters())  # the inputs stay untouched


def test_merge_holds_one_group_of_tensors_at_a_time(monkeypatch):
    """The merge of models in memory copies no parent: the engine holds one group of tensors'
    float32 working copies at a time (the parents' own tensors are read as they are), so a
    bf16 pair needs its own memory and the merged model's, not float32 states of both
    (what lets a 7B merge fit an 80 GB GPU)."""
    from symgraph.merging.streaming import StreamingMerge
    jobs = []
    real = StreamingMerge.write_into

    def spy(self, add, device=None):  # the combine's peak (aligning reads through its own views first)
        jobs.append(self)
        self.resources.ledger.peak = self.resources.ledger.now
        return real(self, add, device)
    monkeypatch.setattr(StreamingMerge, "write_into", spy)
    a, b = _pair(torch.bfloat16)
    symgraph.merge([a, b])
    (job,) = jobs
    largest = max(sum(4 * a.get_parameter(n).numel() for n in task.names) for task in job.plan().tasks if task.names)
    parent = sum(p.numel() * p.element_size() for p in a.parameters())
    assert 0 < job.resources.ledger.peak <= 3 * largest  # two models' copies of a group and its merge
    assert job.resources.ledger.peak < parent  # less than one bf16 parent, let alone two float32 states


def test_nothing_is_created_on_the_default_device():
    """With the default device set to ``meta``, a tensor created without the model's device
    would be a meta tensor and fail against the CPU weights: transform, Alignment.state and
    Alignment.apply must give the same CPU results as without it."""
    a, b = _pair(torch.float32)
    ra = symgraph.analyze(a)
    t = ra.random_transform(seed=2)
    al = symgraph.align(a, b, report_a=ra)
    assert any(isinstance(e, Perm) for e in al.elements.values())
    ref_t, ref_s = symgraph.transform(a, t), al.state(b)
    with torch.device("meta"):
        got_t, got_s, got_b = symgraph.transform(a, t), al.state(b), al.apply(b)
    for k, p in ref_t.named_parameters():
        assert got_t.get_parameter(k).device.type == "cpu" and torch.equal(got_t.get_parameter(k), p), k
    for k, v in ref_s.items():
        assert got_s[k].device.type == "cpu" and torch.equal(got_s[k], v), k
        assert torch.equal(got_b.get_parameter(k).detach(), v), k


def _need_cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    assert acc is None or acc.type == "cuda", (
        f"torch's accelerator is {acc.type!r}: a PrivateUse1 backend (the fakegpu test device) is "
        "registered in this process and CUDA backward passes fail; run the gpu tests with SYMGRAPH_GPU_TESTS=1")


@pytest.mark.gpu
def test_pipeline_on_cuda():
    """analyze / transform / align / merge on a TinyLlama-shaped random model on CUDA: every
    output on the GPU in bf16, a transformed copy recovered, the certificate in float64."""
    _need_cuda()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg).eval().double().cuda()
    report = symgraph.analyze(a)
    # 1e-7, also on the CPU: HF's LlamaRMSNorm computes in float32 even in a float64 model
    assert report.certify(a) < 1e-6
    b = symgraph.transform(a, report.random_transform(seed=1, orthogonal=True))
    assert all(p.is_cuda for p in b.parameters())
    al = symgraph.align(a, b, report_a=report)
    back = al.apply(b)
    err = max(float((back.get_parameter(k) - p).abs().max()) for k, p in a.named_parameters())
    assert err < 1e-8
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    res = symgraph.merge([a16, b16])
    assert {(p.device.type, p.dtype) for p in res.model.parameters()} == {("cuda", torch.bfloat16)}
    x = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        la, lm = a16(x).logits.float(), res.model(x).logits.float()
    assert (la - lm).abs().max() < 0.1 * la.abs().max()


def _flows(A, B, data):
    """Every path of the pipeline, as ``{name: state dict}`` (and the report's certificate)."""
    rep = symgraph.analyze(A)
    out = {"transform": symgraph.transform(A, rep.random_transform(seed=0)).state_dict()}
    al = symgraph.align(A, B, report_a=rep)
    out["align_weights"] = al.apply(B).state_dict()
    out["align_activations"] = symgraph.align(A, B, data=data, report_a=rep).apply(B).state_dict()
    out["full_groups"] = symgraph.align(A, B, report_a=rep, full_groups=True, rescale=True).apply(B).state_dict()
    out["refine"] = symgraph.align(A, B, data=data, report_a=rep, refine=2).apply(B).state_dict()
    out["merge_repair"] = symgraph.merge([A, B], align="activations", data=data, repair=True).model.state_dict()
    out["merge_fisher"] = symgraph.merge([A, B], method="fisher", data=data).model.state_dict()
    out["universe"] = symgraph.merge([A, B], anchor="universe").model.state_dict()
    out["circuits"] = symgraph.merge([A, B], attention="circuits").model.state_dict()
    return out


def _pipeline_on(dev, atol=1e-6, rtol=1e-5, engine_atol=1e-5):
    """Every flow of ``_flows`` on ``dev`` equals the CPU run, and every result stays on ``dev``;
    ``engine_atol`` for the merges the engine aligns, which solves rotations in float32 (its
    SVDs on the two devices differ by about 1e-5 in a rotation's entries; ``symgraph.align``'s
    float64 ones agree to 1e-7), as ``symgraph merge`` on a device is held to."""
    from symgraph.testing.models import build
    a, b = build("llama", seed=0), build("llama", seed=1)  # use_cache=False: HF's cache makes tensors from lists
    data = [{"input_ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(i))} for i in range(3)]
    want = _flows(a, b, data)
    A, B = copy.deepcopy(a).to(dev), copy.deepcopy(b).to(dev)
    got = _flows(A, B, [{k: v.to(dev) for k, v in x.items()} for x in data])
    for flow, state in want.items():
        for k, v in state.items():
            g = got[flow][k]
            assert g.device.type == dev.type, (flow, k, g.device)
            tol = max(atol, engine_atol) if flow in ("merge_repair", "merge_fisher", "circuits") else atol
            assert torch.allclose(g.cpu(), v, atol=tol, rtol=rtol), (flow, k, float((g.cpu() - v).abs().max()))


@pytest.mark.slow  # the default suite took 747 s at 29a92d8 (budget 600 s); the other fakegpu tests here and benchmarks/tests/test_bench_device_disk.py keep the device path
def test_the_pipeline_on_a_device_that_is_not_the_cpu():
    """The whole pipeline on ``fakegpu`` (symgraph.testing.device: PyTorch's PrivateUse1 key
    from Python, computing on the CPU inside): an op mixing its tensors with CPU tensors
    raises, so a tensor the library creates on the default device fails here, without a GPU.
    Every result stays on the device and equals the CPU run."""
    from symgraph.testing.device import install
    _pipeline_on(torch.device(install()))


@pytest.mark.gpu
def test_the_pipeline_on_cuda():
    """The same flows on a CUDA device: the same permutations and maps as on the CPU (float32
    products in another order: equal to 1e-4)."""
    _need_cuda()
    _pipeline_on(torch.device("cuda"), atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
def test_cli_merge_on_cuda(tmp_path):
    """``symgraph merge --device cuda`` on saved checkpoints: the output equals the CPU run's."""
    _need_cuda()
    from safetensors.torch import load_file
    from symgraph.cli.main import main
    from symgraph.testing.models import build
    for seed in (0, 1):
        build("llama", seed=seed).save_pretrained(tmp_path / f"m{seed}")
    args = [str(tmp_path / "m0"), str(tmp_path / "m1"), "--align", "weights"]
    assert main(["merge", *args, "--device", "cuda", "--out", str(tmp_path / "gpu")]) == 0
    assert main(["merge", *args, "--out", str(tmp_path / "cpu")]) == 0
    got, want = load_file(str(tmp_path / "gpu" / "model.safetensors")), load_file(str(tmp_path / "cpu" / "model.safetensors"))
    assert set(got) == set(want)
    for k in got:
        assert torch.allclose(got[k], want[k], atol=1e-4, rtol=1e-3), (k, float((got[k] - want[k]).abs().max()))


def test_cli_merge_on_a_device(tmp_path, capsys):
    """``symgraph merge --device DEV``: the models are loaded and merged there, the output is the
    CPU run's; a CUDA device on a machine without one is one line."""
    from safetensors.torch import load_file
    from symgraph.cli.main import main
    from symgraph.testing.device import install
    from symgraph.testing.models import build
    dev = install()
    for seed in (0, 1):
        build("llama", seed=seed).save_pretrained(tmp_path / f"m{seed}")
    args = [str(tmp_path / "m0"), str(tmp_path / "m1"), "--align", "weights"]
    assert main(["merge", *args, "--device", dev, "--out", str(tmp_path / "on_dev")]) == 0
    assert main(["merge", *args, "--out", str(tmp_path / "on_cpu")]) == 0
    got, want = load_file(str(tmp_path / "on_dev" / "model.safetensors")), load_file(str(tmp_path / "on_cpu" / "model.safetensors"))
    # float32 outputs, solved by the device's polar iteration on one side and LAPACK on the
    # other: equal to a few float32 ulps of the largest weights (1.1e-6 after the 4 sweeps of
    # until="gap", 6.8e-7 after 6 exact ones)
    assert set(got) == set(want) and all(torch.allclose(got[k], want[k], atol=1e-5) for k in got)
    capsys.readouterr()
    if not torch.cuda.is_available():
        assert main(["merge", *args, "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert "CUDA device but this machine has none" in " ".join(err.split()) and err.count("symgraph:") == 1
    assert main(["merge", *args, "--device", "toaster", "--out", str(tmp_path / "x")]) == 2
    assert "not a device name" in capsys.readouterr().err


def test_batched_decompositions_go_to_the_host(monkeypatch):
    """PyTorch's CUDA eigh and SVD decompose a batch of matrices larger than 32² one by one
    (a 7B layer's 1024 head pairs of 128²: seconds on a GPU). On a device that is not the CPU,
    ``nested_heads`` scores the head pairs and ``procrustes`` rotates the matched ones through
    the host's LAPACK: the decompositions see CPU tensors, the results are back on the device
    and equal the CPU run's. Single matrices and batches of small ones stay on the device."""
    from symgraph.solve import _solvers as SV
    from symgraph.testing.device import install
    dev = torch.device(install())
    monkeypatch.setattr(SV, "ON_DEVICE", False)  # the decompositions, not the polar iteration (test_solvers_device)
    seen = []
    for name in ("svd", "eigvalsh"):
        real = getattr(torch.linalg, name)
        monkeypatch.setattr(torch.linalg, name,
                            lambda x, *a, _r=real, _n=name, **k: seen.append((_n, x.device.type, tuple(x.shape))) or _r(x, *a, **k))
    g = torch.Generator().manual_seed(0)
    S = torch.randn(4, 4, 40, 40, generator=g, dtype=torch.float64)
    S[torch.arange(4), torch.tensor([2, 0, 3, 1])] += 3 * torch.eye(40, dtype=torch.float64)
    want_out, want_in = SV.nested_heads([S], ["orthogonal"], [None])
    seen.clear()
    out, inner = SV.nested_heads([S.to(dev)], ["orthogonal"], [None])
    assert seen == [("eigvalsh", "cpu", (4, 4, 40, 40)), ("svd", "cpu", (4, 40, 40))]
    assert inner[0].device.type == dev.type and out.element.device.type == dev.type
    assert torch.equal(inner[0].cpu(), want_in[0]) and torch.equal(out.element.cpu(), want_out.element)
    assert out.element.cpu().argmax(0).tolist() == [1, 3, 0, 2]
    seen.clear()
    SV.procrustes(S[0, 0].to(dev))                  # one matrix: the device's own kernel
    SV.procrustes(S[:, :, :8, :8].to(dev))          # a batch of 8²: batched on the device
    assert seen == [("svd", dev.type, (40, 40)), ("svd", dev.type, (4, 4, 8, 8))]


def test_the_test_device_keeps_its_shapes():
    """``fakegpu`` factories that fill a resized ``out=`` tensor (``arange``, ``eye``: the circuit
    -space program's ``arange``) and in-place view ops (``squeeze_``, which ends a vector-matrix
    product) leave the device tensor's own shape equal to the values' inside, so autograd through
    them works (learned matching moves 1-d biases by ``t @ M.mT`` and casts them)."""
    from symgraph.testing.device import install
    dev = torch.device(install())
    for x, shape in ((torch.arange(32, device=dev), (32,)), (torch.arange(2, 32, 3, device=dev), (10,)),
                     (torch.eye(3, 4, device=dev), (3, 4))):
        assert x.device.type == dev.type and tuple(x.shape) == tuple(x.raw.shape) == shape
    t = torch.randn(5, dtype=torch.float64, requires_grad=True)
    M = torch.randn(5, 5, dtype=torch.float64)
    y = t.to(dev) @ M.to(dev).mT
    assert tuple(y.shape) == tuple(y.raw.shape) == (5,)
    y.to(torch.float32).sum().backward()
    torch.testing.assert_close(t.grad, M.sum(0))

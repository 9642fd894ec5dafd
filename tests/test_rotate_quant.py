"""Rotation against activation outliers (issue 64): a model whose norm gains have a few
channels ×30 (as trained LLMs have) loses clearly less under per-token int8 activation
quantization once rotated; a residual-stream outlier (massive activations) is spread by the
rotation where folding the gains alone leaves it. Simulated quantizer: symgraph.testing.quantize."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.core.ties import untie
from symgraph.testing import models
from symgraph.testing import quantize as Q

OUTLIERS = [3, 17, 40]
SIZES = {"llama": dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, positions=64),
         "gpt2": dict(vocab=128, hidden=64, layers=2, heads=4, mlp=128, positions=64)}


def outlier_model(arch, stream=False):
    """A tiny model whose foldable norm gains are ×30 on :data:`OUTLIERS` (and, with
    ``stream``, whose embedding is too: those channels of the residual stream are large)."""
    m = models.build(arch, seed=0, **SIZES[arch])
    report = symgraph.analyze(untie(m))  # GPT-2 ties its head: its untied report names the norms
    with torch.no_grad():
        for f in report.folds:
            m.get_parameter(f.gain)[OUTLIERS] *= 30
        if stream:
            m.get_input_embeddings().weight[:, OUTLIERS] *= 30
    return m


def quant_error(model, x, bits=8, modules=None):
    """Relative change of the logits when the linear layers' inputs are rounded per token."""
    with torch.no_grad():
        a = model(input_ids=x).logits.double()
        with Q.activations(model, bits, modules=modules):
            b = model(input_ids=x).logits.double()
    return float((a - b).norm() / a.norm())


def norm_readers(result):
    """Module names of the linear layers that read a folded norm (where the stream is read)."""
    return {w.rsplit(".", 1)[0] for f in result.report.folds for w, _, _ in f.readers}


X = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rotation_removes_norm_gain_outliers(arch):
    m = outlier_model(arch)
    rot = symgraph.rotate(m, how="hadamard", seed=0)
    before, after = quant_error(m, X), quant_error(rot.model, X)
    readers = norm_readers(rot)
    rb, ra = quant_error(m, X, modules=readers), quant_error(rot.model, X, modules=readers)
    print(f"{arch}: int8 per-token, whole model {before:.4f} -> {after:.4f} ({before / after:.2f}x); "
          f"stream readers {rb:.4f} -> {ra:.4f} ({rb / ra:.2f}x)")
    assert before / after >= 1.4
    assert rb / ra >= 1.5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rotation_spreads_a_stream_outlier_folding_alone_does_not(arch):
    m = outlier_model(arch, stream=True)
    rot = symgraph.rotate(m, how="hadamard", seed=0)
    fold = symgraph.rotate(m, classes=())  # the same folds, no rotation
    assert fold.elements == {}
    readers = norm_readers(rot)
    rf, ra = quant_error(fold.model, X, modules=readers), quant_error(rot.model, X, modules=readers)
    print(f"{arch}: stream outliers, int8 at the stream readers: folded {rf:.4f}, rotated {ra:.4f} ({rf / ra:.2f}x)")
    assert rf / ra >= 1.3


def test_rtn_groups_and_ste():
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)
    q = Q.rtn(w, bits=4, group=128)
    for row in range(4):
        for g in range(2):
            part = q[row, g * 128:(g + 1) * 128]
            scale = w[row, g * 128:(g + 1) * 128].abs().max().item() / 7
            assert torch.allclose(part / scale, torch.round(part / scale), atol=1e-4)
            assert len(torch.unique(torch.round(part / scale))) <= 16
    Q.rtn(w, 4, 128, ste=True).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_stacked_experts_are_quantized():
    """Mixtral's experts ([experts, out, in] parameters) have their weights rounded along the
    input and their input rounded per token."""
    m = models.build("mixtral", seed=0)
    (name, experts), = [(n, e) for n, e in Q.stacked_experts(m).items() if n.startswith("model.layers.0.")]
    q = Q.quantize_weights(m, bits=4, group=8)
    for pname, p in experts.named_parameters(recurse=False):
        w, wq = p.detach(), q.get_submodule(name).get_parameter(pname).detach()
        assert not torch.equal(w, wq)
        assert torch.equal(wq, Q.rtn(w, 4, 8, -1))
    seen = []
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Q.activations(m, bits=4):  # the observer runs after the rounding hook
        h = experts.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().clone()))
        m(input_ids=x)
    h.remove()
    (got,) = seen
    scale = got.abs().amax(-1, keepdim=True) / 7
    assert torch.allclose(got / scale, torch.round(got / scale), atol=1e-4)  # 4-bit levels per token

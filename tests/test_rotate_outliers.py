"""symgraph.rotation.outliers.with_outliers (issue 64's benchmark variant): a few channels of
every foldable norm's gain ×30 and its readers' input columns ×1/30, from the report's folds
alone: the function is kept (float32, 1e-5), the readers' inputs get ×30 outlier channels,
per-token int8 activations lose much more, and a rotation takes that loss away again."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import InputError
from symgraph.core.ties import untie
from symgraph.rotation.outliers import with_outliers
from symgraph.testing import models

from function_helpers import logits as _logits, rel
from symgraph.testing import quantize as Q

pytest.importorskip("transformers")

SIZES = {"llama": dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, positions=64),
         "gpt2": dict(vocab=128, hidden=64, layers=2, heads=4, mlp=128, positions=64),
         "mixtral": dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, mlp=64, positions=64)}
X = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))


def build(arch):
    return models.randomize_vectors(models.build(arch, seed=0, **SIZES[arch]), seed=1)


def logits(m, x=X):
    return _logits(m, x)


def reader_inputs(model, names):
    """``{module name: its input on X}`` for the modules ``names``."""
    seen, handles = {}, []
    for name in names:
        mod = model.get_submodule(name)
        handles.append(mod.register_forward_pre_hook(lambda _m, a, n=name: seen.setdefault(n, a[0].detach())))
    logits(model)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
@pytest.mark.slow
def test_outliers_keep_the_function_and_scale_gains_and_readers(arch):
    m = build(arch)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    o = with_outliers(m, channels=4, factor=30.0, seed=0)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # the input untouched
    (ch,) = o.channels.values()
    assert len(ch) == 4 and len(set(ch)) == 4
    assert o.error <= 1e-5 and rel(logits(m), logits(o.model)) <= 1e-5
    assert o.untied == (arch == "gpt2")  # GPT-2's tied head: untied, so its final norm folds too
    report = symgraph.analyze(o.model)
    assert sorted(f.gain for f in report.folds) == sorted(o.norms) and len(o.norms) == 5
    new = dict(o.model.named_parameters())
    old = dict((untie(m) if o.untied else m).named_parameters())
    assert new.keys() == old.keys()
    rest = [c for c in range(64) if c not in ch]
    for f in report.folds:
        torch.testing.assert_close(new[f.gain][ch], old[f.gain][ch] * 30, rtol=1e-6, atol=0)
        assert torch.equal(new[f.gain][rest], old[f.gain][rest])
        if f.shift:
            torch.testing.assert_close(new[f.shift][ch], old[f.shift][ch] * 30, rtol=1e-6, atol=0)
        for w, axis, _ in f.readers:
            idx = torch.tensor(ch)
            torch.testing.assert_close(new[w].index_select(axis, idx), old[w].index_select(axis, idx) / 30,
                                       rtol=1e-6, atol=0)
            assert torch.equal(new[w].index_select(axis, torch.tensor(rest)),
                               old[w].index_select(axis, torch.tensor(rest)))


def test_readers_inputs_get_outlier_channels():
    m = build("llama")
    o = with_outliers(m)
    (ch,) = o.channels.values()
    rest = [c for c in range(64) if c not in ch]
    names = {w.rsplit(".", 1)[0] for f in symgraph.analyze(o.model).folds for w, _, _ in f.readers}
    names = [n for n in names if isinstance(o.model.get_submodule(n), torch.nn.Linear)]
    assert len(names) == 2 * 5 + 1  # q, k, v, gate and up per layer; the head (lm_head)
    a, b = reader_inputs(m, names), reader_inputs(o.model, names)
    for n in names:
        ratio = b[n][..., ch].abs().mean(dim=(0, 1)) / a[n][..., ch].abs().mean(dim=(0, 1))
        torch.testing.assert_close(ratio, torch.full_like(ratio, 30.0), rtol=1e-4, atol=0)
        torch.testing.assert_close(b[n][..., rest], a[n][..., rest], rtol=1e-5, atol=1e-6)


def quant_error(model, bits=8):
    """Relative change of the logits when the linear layers' inputs are rounded per token."""
    a = logits(model)
    with Q.activations(model, bits):
        b = logits(model)
    return rel(a, b)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_outliers_cost_int8_activations_and_rotation_removes_the_cost(arch):
    m = build(arch)
    o = with_outliers(m)
    plain, outl = quant_error(m), quant_error(o.model)
    rotated = quant_error(symgraph.rotate(o.model, how="hadamard", seed=0).model)
    print(f"{arch}: int8 per token: plain {plain:.4f}, outliers {outl:.4f}, outliers rotated {rotated:.4f}")
    assert outl >= 3 * plain
    assert rotated <= outl / 3


def test_folding_the_outlier_variant_gives_the_plain_models_folded_weights():
    """The variant is the plain model in another gauge of its norms: folded, they agree."""
    m = build("llama")
    o = with_outliers(m)
    a, b = symgraph.rotate(m, classes=()), symgraph.rotate(o.model, classes=())
    for k, v in a.model.state_dict().items():
        torch.testing.assert_close(b.model.state_dict()[k], v, rtol=1e-5, atol=1e-7)


def test_refusals():
    with pytest.raises(InputError, match="no foldable norm"):
        with_outliers(models.build("bert", seed=0))  # post-norm: the norm's output is the stream
    m = build("llama")
    with pytest.raises(InputError, match="channels=0"):
        with_outliers(m, channels=0)
    with pytest.raises(InputError, match="has only 64"):
        with_outliers(m, channels=65)
    with pytest.raises(InputError, match="factor"):
        with_outliers(m, factor=-1.0)

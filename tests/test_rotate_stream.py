"""Massive residual-stream channels (issue 64): trained into a tiny model through its token
embedding (symgraph.rotation.stream), they survive folding the norm gains: the folded model's
norm readers still see them and per-token int8 activations crush the other channels; a
Hadamard rotation of the stream spreads them (much lower quantization error, of the readers'
inputs and of the logits) and the rotated model certifies."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import InputError
from symgraph.rotation.stream import channel_ratio, norm_input_ratios, with_massive_channels
from symgraph.testing import models
from symgraph.testing import quantize as Q

from function_helpers import logits, rel

pytest.importorskip("transformers")

SIZES = {"llama": dict(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, positions=32),
         "gpt2": dict(vocab=64, hidden=64, layers=2, heads=4, mlp=128, positions=32)}
X = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))


def sampler(seed=0):
    """Batches of a learnable sequence: each token the previous one plus a per-sequence step (mod 64)."""
    gen = torch.Generator().manual_seed(seed)

    def sample():
        start = torch.randint(0, 64, (8, 1), generator=gen)
        step = torch.randint(1, 4, (8, 1), generator=gen)
        x = (start + step * torch.arange(24)) % 64
        return {"input_ids": x, "labels": x}
    return sample


def trained(arch, massive=True, steps=40):
    """A tiny ``arch`` trained ``steps`` steps; ``massive``: with 2 massive stream channels put in first."""
    m = models.build(arch, seed=0, **SIZES[arch])
    if massive:
        m = with_massive_channels(m, channels=2, factor=30.0, seed=0).model
    models.train(m, sampler(), steps=steps, lr=1e-3)
    return m.eval()


def readers(res, gains) -> set:
    """The module names of the readers of the folded norms ``gains`` in ``res.report``."""
    return {w.rpartition(".")[0] for f in res.report.folds if f.gain in gains for w, _, _ in f.readers}


def reader_quant_error(model, names, bits=8) -> float:
    """Relative error ``‖Q(x) − x‖ / ‖x‖`` of per-token ``bits``-bit rounding, pooled over the inputs
    of the modules ``names`` of ``model`` on X."""
    err, tot, handles = [0.0], [0.0], []

    def hook(_m, args):
        x = args[0].detach().double()
        err[0] += float((Q.per_token(x, bits) - x).pow(2).sum())
        tot[0] += float(x.pow(2).sum())
    for name in names:
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    logits(model, X)
    for h in handles:
        h.remove()
    assert names and tot[0] > 0
    return (err[0] / tot[0]) ** 0.5


def a8_logit_error(model, names) -> float:
    """Relative change of ``model``'s logits on X when the modules ``names`` see their inputs rounded
    per token to int8."""
    with Q.activations(model, 8, modules=names):
        q = logits(model, X)
    return rel(logits(model, X), q)


def test_massive_channels_are_added_to_the_embedding_only():
    m = models.build("llama", seed=0, **SIZES["llama"])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    got = with_massive_channels(m, channels=3, factor=20.0, seed=1)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # the input untouched
    emb = "model.embed_tokens.weight"
    rms = float(before[emb].double().pow(2).mean().sqrt())
    assert len(got.channels) == 3 and got.offset == pytest.approx(20.0 * rms, rel=1e-12)
    new = got.model.state_dict()
    rest = [c for c in range(64) if c not in got.channels]
    torch.testing.assert_close(new[emb][:, got.channels], before[emb][:, got.channels] + got.offset)
    assert torch.equal(new[emb][:, rest], before[emb][:, rest])
    assert all(torch.equal(new[k], v) for k, v in before.items() if k != emb)
    with pytest.raises(InputError, match="channels=0"):
        with_massive_channels(m, channels=0)


def test_channel_ratio():
    x = torch.ones(5, 7, 8)
    assert channel_ratio(x) == pytest.approx(1.0)
    x[..., 3] = 40.0
    assert channel_ratio(x) == pytest.approx(40.0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.slow
def test_rotation_spreads_massive_stream_channels_that_folding_keeps(arch):
    plain, massive = trained(arch, massive=False), trained(arch)
    run = lambda m: logits(m, X)  # noqa: E731
    first = lambda r: next(iter(r.values()))  # noqa: E731  the first norm's input: the embedding's output
    ratios = norm_input_ratios(massive, run)
    assert first(norm_input_ratios(plain, run)) < 4 < 8 < first(ratios)
    massive_norms = {g for g, r in ratios.items() if r > 8}  # where the stream's channels are massive
    fold = symgraph.rotate(massive, how="hadamard", classes=())
    had = symgraph.rotate(massive, how="hadamard")
    for res in (fold, had):  # both certify: the function is the trained model's
        assert res.error <= 1e-5 and rel(logits(massive, X), logits(res.model, X)) <= 1e-5
    assert first(norm_input_ratios(fold.model, run)) > 8  # folding leaves them
    assert readers(fold, massive_norms) == readers(had, massive_norms) != set()
    names = readers(fold, massive_norms)
    e_fold, e_had = reader_quant_error(fold.model, names), reader_quant_error(had.model, names)
    assert e_had < 0.7 * e_fold, (e_fold, e_had)
    a_fold, a_had = a8_logit_error(fold.model, names), a8_logit_error(had.model, names)
    assert a_had < 0.7 * a_fold, (a_fold, a_had)

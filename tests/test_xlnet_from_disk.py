"""XLNet from disk and in every dtype: ``symgraph merge a b`` of two saved XLNets (issue 69).

XLNet makes its attention projections and its mask embedding with a legacy constructor
(``nn.Parameter(torch.FloatTensor(...))``), which ignores ``torch.device("meta")``: the model an
out-of-core merge builds from the config held them on the CPU beside every other parameter on
meta, and its trace failed (``FakeTensorDeviceMismatchError: meta and cpu``). The model is now
built with every parameter put on meta as it is registered
(:func:`symgraph.core.devices.parameters_on_meta`).

Asserted: every parameter of a checkpoint's model on meta; the report of that model traced on
meta the same as the in-memory model's (every head class included); the command-line merge
equal to ``symgraph.merge`` in memory; a model that cannot be traced on meta refused in one
line (exit 2), never a traceback. And XLNet in float64, bfloat16 and float16 claims what it
claims in float32 (its query stream's contraction of float32 positions with the weights run in
the weights' dtype: :func:`symgraph.core.dtypes.parameters_dtype`).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import symgraph
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.cli.main import main
from symgraph.core import devices

from engine_helpers import load

transformers = pytest.importorskip("transformers")

D, H, HD, V = 16, 4, 4, 64


def xlnet(seed: int, dtype=torch.float32):
    cfg = transformers.XLNetConfig(vocab_size=V, d_model=D, n_layer=2, n_head=H, d_head=HD, d_inner=24,
                                   dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.XLNetLMHeadModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # XLNet initialises its biases to zeros: give every parameter values
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(dtype).eval()


def classes(report) -> list:
    return sorted((g.kind, g.size, g.dim, g.blocks) for g in report.groups)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("xlnet_disk")
    built = [xlnet(0), xlnet(1)]
    for name, m in zip("ab", built):
        m.save_pretrained(root / name)
    return root, built


def test_every_parameter_of_a_checkpoints_model_on_meta(pair):
    root, _ = pair
    model = Checkpoint(str(root / "a")).model
    assert [n for n, p in model.named_parameters() if not p.is_meta] == []
    for n in ("transformer.mask_emb", "transformer.layer.0.rel_attn.q", "transformer.layer.1.rel_attn.seg_embed"):
        assert model.get_parameter(n).is_meta


@pytest.mark.slow
def test_meta_trace_claims_what_the_in_memory_one_does(pair):
    root, built = pair
    on_meta = symgraph.analyze(Checkpoint(str(root / "a")).model)
    in_memory = symgraph.analyze(built[0])
    assert classes(on_meta) == classes(in_memory)
    # the per-head QK and VO maps of both layers, the head orders, the MLP widths
    assert sum(g.kind == "gl" and g.blocks == H and g.dim == HD for g in on_meta.groups) == 4
    assert sum(g.kind == "perm" and g.size == H for g in on_meta.groups) == 2
    assert on_meta.frozen == []


@pytest.mark.slow
def test_command_line_merge_equals_the_in_memory_merge(pair, capsys):
    root, built = pair
    out = root / "out"
    assert main(["merge", str(root / "a"), str(root / "b"), "--out", str(out)]) == 0, capsys.readouterr().err
    got, ref = load(out), symgraph.merge(built).model.state_dict()
    assert set(got) == set(load(root / "a"))  # every tensor save_pretrained wrote (the tied head once)
    assert max(float((got[k].double() - ref[k].double()).abs().max()) for k in got) <= 1e-6
    assert all(got[k].dtype == torch.float32 for k in got)
    # aligned, not a plain average: B's heads and MLP units were moved into A's basis first
    plain = {k: (built[0].state_dict()[k] + built[1].state_dict()[k]) / 2 for k in got}
    assert max(float((got[k] - plain[k]).abs().max()) for k in got) > 0.05


def test_a_model_that_cannot_be_traced_on_meta_is_refused_in_one_line(pair, capsys, monkeypatch):
    """Without every parameter on meta (as before the fix) the trace mixes devices: the command
    exits 2 with one line naming the trace failure, and writes nothing."""
    root, _ = pair
    monkeypatch.setattr(devices, "parameters_on_meta", contextlib.nullcontext)
    out = root / "refused"
    rc = main(["merge", str(root / "a"), str(root / "b"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("symgraph:") == 1 and "Traceback" not in err, err
    flat = " ".join(err.split())
    assert "torch.export could not trace XLNetLMHeadModel" in flat and "meta and cpu" in flat, flat
    assert not out.exists()


# --- every dtype: the same claims as float32 -----------------------------------------------
# XLNet's query stream (target_mapping, which reads its mask embedding) contracts its relative
# positions, made at float32 (``arange(...).float()``), with the weights without casting them
# (its other stream does): float64, bfloat16 and float16 weights refuse them, so the model kept
# no query stream, left ``mask_emb`` unread and claimed nothing. Such a contraction now runs in
# the parameters' dtype (core.dtypes.parameters_dtype).
NARROW_AND_WIDE = [torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", NARROW_AND_WIDE)
@pytest.mark.slow
def test_every_dtype_claims_what_float32_does(dtype):
    from test_dtype_independence import summary
    r32, model = symgraph.analyze(xlnet(0)), xlnet(0, dtype)
    r = symgraph.analyze(model)
    assert "target_mapping" in r.inputs[1] and r.inputs[1]["target_mapping"].dtype == dtype
    assert summary(r) == summary(r32)
    assert sum(g.kind == "gl" and g.blocks == H for g in r.groups) == 4
    assert r.certify(model, tol=1e-9) < 1e-9


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.slow
def test_a_checkpoint_on_meta_claims_what_float32_does(tmp_path, dtype):
    xlnet(0, dtype).save_pretrained(tmp_path / "a")
    model = Checkpoint(str(tmp_path / "a")).model
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert classes(symgraph.analyze(model)) == classes(symgraph.analyze(xlnet(0)))


def test_a_contraction_torch_accepts_runs_as_it_is():
    """Only a contraction torch refuses (floating operands of two dtypes) is cast: one of a
    single dtype, even not the parameters', and every other op, run unchanged."""
    from symgraph.core.dtypes import parameters_dtype
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5)
    with parameters_dtype(model):
        same = torch.einsum("ij,jk->ik", a, a.T @ a)
        mixed = torch.einsum("ij,jk->ik", a.float(), b.to(torch.bfloat16))
        added = a + b.sum()
    assert same.dtype == torch.float64 and added.dtype == torch.float64
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed, a.to(torch.bfloat16) @ b.to(torch.bfloat16))
    with pytest.raises(RuntimeError):  # outside: refused, as torch refuses it
        torch.einsum("ij,jk->ik", a.float(), b.to(torch.bfloat16))

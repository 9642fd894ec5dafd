"""Work the alignment does once rather than twice: a float32 similarity assigned as it is,
and B's slices that a unit's rotation and permutation classes both read mapped once."""
from __future__ import annotations

import numpy as np
import torch

import symgraph
from symgraph.core.elements import apply_along
from symgraph.solve import _solvers as SV
from symgraph.testing import models as M


def test_float32_similarity_is_ranked_as_is(monkeypatch):
    """A square float32 similarity is assigned in float32 (no float64 copy of an MLP's n×n):
    the same permutation, status and objective as its float64 copy, sparse and dense, with
    ties (values on a coarse grid) and with every row's best column distinct."""
    monkeypatch.setattr(SV, "SPARSE_N", 64)
    rng = np.random.default_rng(5)
    seen = set()
    for n, grid in ((40, 0.0), (96, 0.0), (96, 0.25), (128, 1.0)):
        s = torch.from_numpy(rng.standard_normal((n, n))).float()
        if grid:
            s = (s / grid).round() * grid  # many exact ties
        for m in (s, s + 8 * torch.eye(n)):  # the second: the row maxima answer
            got, want = SV.solve("perm", m, dense=False), SV.solve("perm", m.double(), dense=False)
            assert torch.equal(got.element.index, want.element.index)
            assert got.status == want.status and got.objective == want.objective
            seen.add(got.status)
    assert seen == {"optimal", "optimal (row maxima)", "optimal among top-64 candidates"}
    assert SV._ranked_as_is(s) and not SV._ranked_as_is(s.double()) and not SV._ranked_as_is(s[:, :3])


def test_rotation_and_permutation_classes_of_a_unit_map_bs_slice_once(monkeypatch):
    """A head family's rotation classes (RoPE, per-head GL) and its head permutation read the
    same slices of B (queries, outputs) with the residual stream's rotation applied: 16-bit
    weights are mapped once, in the exact dtype, and the permutation class ranks that product
    rounded to bf16; float32 weights keep their own product."""
    import symgraph.alignment.weights as W
    from symgraph.alignment.options import AlignOptions
    from symgraph.alignment.sweeps import Sweeps
    A, B = M.build("llama", seed=0), M.build("llama", seed=1)
    ra, rb = symgraph.analyze(A), symgraph.analyze(B)
    elements = symgraph.align(A, B, report_a=ra, report_b=rb).elements
    for dtype in (torch.bfloat16, torch.float32):
        feats = W.WeightFeatures.from_models(ra, rb, A.to(dtype), B.to(dtype), exact_dtype=torch.float32)
        Sweeps(ra, AlignOptions(), feats, None)  # notes the shared slots
        shared = sorted(feats.mapped_once)
        assert shared and {n.rsplit(".", 2)[-2] for n, _ in shared} == {"q_proj", "o_proj"}
        calls = []
        monkeypatch.setattr(W, "apply_along", lambda t, k, M_: calls.append(1) or apply_along(t, k, M_))
        for name, d in shared:
            ax = rb.param_axes(name)
            tb = rb.view(name, feats.B[name])
            (k,) = [k for k in range(len(ax)) if k != d]
            R = feats._axis_op(ax[k], elements)
            assert R is not None and R.dim() == 2
            want = apply_along(tb.float(), k, R)
            del calls[:]
            ranked = feats._mapped_b(name, d, tb, [(k, R)], False, tb.dtype)
            exact = feats._mapped_b(name, d, tb.float(), [(k, R)], True, tb.dtype)
            if dtype == torch.bfloat16:
                assert len(calls) == 1  # once for both classes
                assert ranked.dtype == torch.bfloat16 and torch.equal(ranked, want.to(torch.bfloat16))
            else:
                assert len(calls) == 2 and torch.equal(ranked, apply_along(tb, k, R))
            assert exact.dtype == torch.float32 and torch.equal(exact, want)
        monkeypatch.undo()


def test_shard_writer_writes_on_its_thread_the_same_bytes_and_raises_a_failed_write(tmp_path, monkeypatch):
    """The writer's thread writes each value while the next is computed: the files read back
    as ``save_file``'s values (tensors in any order, one in row slices), at most
    ``PENDING`` values held; a failed write is raised by ``close``."""
    import pytest
    from safetensors import safe_open
    import symgraph.checkpoints.sharded as sh
    g = torch.Generator().manual_seed(0)
    vals = {f"t{i}": torch.randn(64 + i, 48, generator=g).to(torch.bfloat16) for i in range(6)}
    plan = [(k, tuple(v.shape), v.dtype) for k, v in vals.items()]
    held = []
    submit = sh.ShardWriter._pool
    monkeypatch.setattr(sh.ShardWriter, "_pool", lambda self: held.append(len(self._pending)) or submit(self))
    w = sh.ShardWriter(str(tmp_path), 20_000, plan)
    for k in reversed(list(vals)):
        if k == "t2":
            for r in range(0, vals[k].shape[0], 16):
                w.add(k, vals[k][r:r + 16].clone())
        else:
            w.add(k, vals[k])
    info = w.close()
    assert info["shards"] > 1 and max(held) <= sh.ShardWriter.PENDING
    got = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    assert got.keys() == vals.keys() and all(torch.equal(got[k], v) for k, v in vals.items())

    def fail(fd, data, at):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(sh, "_pwrite", fail)
    (tmp_path / "x").mkdir()
    w = sh.ShardWriter(str(tmp_path / "x"), None, plan[:1])
    w.add("t0", vals["t0"])
    with pytest.raises(OSError, match="No space left"):
        w.close()

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
            ranked = feats._mapped_b(name, d, tb, ax, elements, False, tb.dtype)
            exact = feats._mapped_b(name, d, tb.float(), ax, elements, True, tb.dtype)
            if dtype == torch.bfloat16:
                assert len(calls) == 1  # once for both classes
                assert ranked.dtype == torch.bfloat16 and torch.equal(ranked, want.to(torch.bfloat16))
            else:
                assert len(calls) == 2 and torch.equal(ranked, apply_along(tb, k, R))
            assert exact.dtype == torch.float32 and torch.equal(exact, want)
        monkeypatch.undo()

"""Theus et al. 2025's weight-matching costs as options of the generic machinery: heads paired
by circuit distance (``head_cost="circuits"``) and residual blocks scaled by their columns
(``block_scale="columns"``)."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.alignment.weights import WeightFeatures, circuit_scores
from symgraph.testing import models


def _rel(m, A, args, kwargs):
    with torch.no_grad():
        o, r = m(*args, **kwargs)[0].double(), A(*args, **kwargs)[0].double()
    return float((o - r).abs().max() / r.abs().max())


def test_circuit_scores_are_the_circuit_distances():
    g = torch.Generator().manual_seed(0)
    H, n, m = 3, 4, 7
    XA, YA, XB, YB = (torch.randn(H, n, m, generator=g, dtype=torch.float64) for _ in range(4))
    S = torch.stack([torch.einsum("aim,bjm->abij", XA, XB), torch.einsum("aim,bjm->abij", YA, YB)])
    GA = torch.stack([XA @ XA.mT, YA @ YA.mT])
    GB = torch.stack([XB @ XB.mT, YB @ YB.mT])
    CA, CB = XA.mT @ YA, XB.mT @ YB  # [H, m, m]
    want = -(CA[:, None] - CB[None]).flatten(2).norm(dim=-1) / CA.flatten(1).norm(dim=-1).mean()
    torch.testing.assert_close(circuit_scores(S, GA, GB), want)


def test_circuit_scores_ignore_the_gl_part_of_a_transformed_copy():
    """B = A under a random element of the full groups (GL per head, not orthogonal): with the
    residual stream aligned, each of B's heads has a partner at circuit distance 0, which the
    alignment picks, and every other pair is farther."""
    A = models.build("gpt2")
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    rb = symgraph.analyze(B)
    al = symgraph.align(A, B, report_a=rep, head_cost="circuits")
    feats = WeightFeatures.from_models(rep, rb, A, B, head_cost="circuits")
    b_groups = {g.id: g for g in rb.groups}
    gl = [g for g in rep.groups if g.kind == "gl"]
    assert len(gl) == 4  # QK and VO in each of the two layers
    for g in gl:
        feats.similarity(g, b_groups[g.id], al.elements, True)
        sc = feats.head_scores[g.id]  # [H_A, H_B]
        best = sc.argmax(0)
        assert float(sc.max(0).values.abs().max()) < 1e-6
        off = sc.clone()
        off[best, torch.arange(sc.shape[1])] = -float("inf")
        assert float(off.max()) < -1e-2
        outer = al.elements[rep.fibre_groups(g.id)[0]]
        dense = outer.dense() if hasattr(outer, "dense") else outer
        assert torch.equal(dense.argmax(0).cpu(), best.cpu())  # the alignment paired them so


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_transformed_copy_merges_back_with_the_anchor_costs(arch):
    A = models.build(arch)
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    args, kwargs = rep.inputs
    m = symgraph.merge([A, B], align="weights", full_groups=True, head_cost="circuits",
                       block_scale="columns").model
    assert _rel(m, A, args, kwargs) < 1e-6


def test_the_options_are_checked():
    A = models.build("gpt2")
    for bad in ({"head_cost": "nuclear"}, {"block_scale": "rows"}):
        with pytest.raises(symgraph.InputError, match=next(iter(bad))):
            symgraph.align(A, A, **bad)

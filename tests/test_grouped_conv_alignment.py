"""Weight matching through a grouped convolution followed directly by a plain convolution whose
output class is unconstrained (``gl``): since grouped convolutions' outputs take a map per group
(6a249e3), the first sweep solved that ``gl`` class, and the grouped outputs, from fewer known
columns than units (the head's few classes and a bias), and the SVD's arbitrary basis of what
that left free put the sweeps in a wrong basin: a model aligned to itself landed 0.86 away, a
transformed copy 1.6-1.9 away even after 40 sweeps. Procrustes now takes what its similarity
leaves free as the identity (B's order), and the first sweep solves the units that their known
slots determine before the ones they cannot.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.solve import procrustes
from symgraph.solve._polar import polar

TOL = 1e-6


class Stack(nn.Module):
    """1x1 or 3x3 convolutions (``(out, groups, relu)``), a spatial mean and a linear head."""

    def __init__(self, c_in, spec, classes):
        super().__init__()
        convs, c = [], c_in
        for out, groups, _ in spec:
            convs.append(nn.Conv2d(c, out, 3 if groups > 1 else 1, padding=int(groups > 1), groups=groups))
            c = out
        self.convs, self.relu = nn.ModuleList(convs), [r for *_, r in spec]
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        for conv, relu in zip(self.convs, self.relu):
            x = torch.relu(conv(x)) if relu else conv(x)
        return self.fc(x.mean(dim=(2, 3)))


def build(c_in, spec, classes, seed):
    torch.manual_seed(seed)
    m = Stack(c_in, spec, classes).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m, torch.randn(2, c_in, 6, 6)


def distance(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


# conv-ReLU, a 2-group conv, a plain conv (gl: nothing after it), a head of 2 classes
STEM = (3, [(8, 1, True), (16, 2, False), (16, 1, False)], 2, 25)
# the 2-group conv reads the input; a plain conv (gl) widens to 16, conv-ReLU, a head of 2
FIRST = (4, [(8, 2, False), (16, 1, False), (8, 1, True)], 2, 1)


@pytest.mark.parametrize("net", [STEM, FIRST], ids=["stem", "first"])
def test_aligned_to_itself_is_the_identity(net):
    m, x = build(*net)
    r = symgraph.analyze(m, (x,))
    assert [g.kind for g in r.groups].count("gl") == 2  # the grouped outputs and the plain conv's
    al = symgraph.align(m, m, (x,), report_a=r, report_b=r)
    assert distance(al.apply(m), m) == 0.0  # was 0.86 (stem) before the fix
    for gid, el in al.elements.items():  # every element the identity, not only its effect
        if isinstance(el, torch.Tensor) and el.dim() >= 2 and el.shape[-1] == el.shape[-2]:
            assert torch.allclose(el.double(), torch.eye(el.shape[-1], dtype=torch.float64).expand_as(el),
                                  atol=1e-12), gid


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_transformed_copy_recovered_after_grouped_conv_then_gl(seed):
    """The stem net: the coupled rotations converge linearly (AlignOptions.max_iter: about 20
    sweeps); before the fix seeds 0 and 1 stayed 1.6 and 1.9 away after 40."""
    m, x = build(*STEM)
    r = symgraph.analyze(m, (x,))
    b = symgraph.transform(m, r.random_transform(seed=seed, orthogonal=True))
    assert distance(b, m) > 0.1
    al = symgraph.align(m, b, (x,), max_iter=40)
    assert distance(al.apply(b), m) <= TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_gl_widening_solved_after_the_head_it_needs(seed):
    """The plain conv's 16 outputs are read by the 2-group conv's 8 channels and a bias (9 known
    columns): the first sweep solves the ReLU class after it (its head known) first, then the
    gl class from all 17 columns; exact with the default sweeps (before: 0.5 for seed 1)."""
    m, x = build(*FIRST)
    r = symgraph.analyze(m, (x,))
    b = symgraph.transform(m, r.random_transform(seed=seed, orthogonal=True))
    al = symgraph.align(m, b, (x,))
    assert distance(al.apply(b), m) <= TOL


def test_procrustes_takes_what_the_similarity_leaves_free_as_the_identity():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 2, generator=g, dtype=torch.float64)  # 2 observations of 6 units
    Q = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    eye = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(procrustes(X @ X.T).element, eye, atol=1e-12)  # a copy of itself
    assert torch.allclose(procrustes(torch.zeros(6, 6, dtype=torch.float64)).element, eye)
    R = procrustes((Q @ X) @ X.T).element  # <R, Q X Xᵀ> is maximal for any R with R X = Q X
    assert torch.allclose(R.T @ R, eye, atol=1e-12) and torch.allclose(R @ X, Q @ X, atol=1e-12)
    # on the rest, the nearest to I: R = Q P Pᵀ + Y Z P⊥ᵀ, P / P⊥ bases of X's span and its
    # complement, Y of the complement of Q P, Z the polar factor of Yᵀ P⊥ (max trace R)
    B = torch.linalg.qr(X, mode="complete")[0]
    P, Pc = B[:, :2], B[:, 2:]
    Y = torch.linalg.qr(Q @ P, mode="complete")[0][:, 2:]
    U, _, Vh = torch.linalg.svd(Y.T @ Pc)
    assert torch.allclose(R, Q @ P @ P.T + Y @ (U @ Vh) @ Pc.T, atol=1e-9)
    S = torch.randn(6, 6, generator=g, dtype=torch.float64)  # full rank: the plain U Vᵀ
    U, _, Vh = torch.linalg.svd(S)
    assert torch.allclose(procrustes(S).element, U @ Vh, atol=1e-12)


def test_device_polar_falls_back_to_the_same_completion():
    """The accelerator's Newton–Schulz polar factor does not converge on a rank-deficient matrix
    and hands it to the SVD: the same completion (run here on the CPU tensors directly)."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    S = X @ X.mT  # a batch of three copies of themselves, rank 2 of 5
    S[1] = torch.randn(5, 5, generator=g, dtype=torch.float64)  # one full rank among them
    Q, info = polar(S)
    assert info["fallback"] == 2
    eye = torch.eye(5, dtype=torch.float64)
    assert torch.allclose(Q[0], eye, atol=1e-12) and torch.allclose(Q[2], eye, atol=1e-12)
    U, _, Vh = torch.linalg.svd(S[1])
    assert torch.allclose(Q[1], U @ Vh, atol=1e-9)

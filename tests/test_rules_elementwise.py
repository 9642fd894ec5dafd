"""Per-op rules, checked through tiny modules: elementwise activations and norms, gating,
residual adds, rounding, casts and functional copies.
"""
from __future__ import annotations

import pytest
import torch

import symgraph

from rules_helpers import B, TOL, analyze, summary, x_of


# --- elementwise --------------------------------------------------------------------------
@pytest.mark.parametrize("act,kind", [
    (torch.nn.ReLU(), "scaled_perm"), (torch.nn.LeakyReLU(0.1), "scaled_perm"),
    (torch.nn.Tanh(), "signed_perm"), (torch.sin, "signed_perm"),
    (torch.nn.GELU(), "perm"), (torch.nn.SiLU(), "perm"), (torch.nn.Sigmoid(), "perm"),
    (torch.nn.Identity(), "gl"), (lambda y: 3.0 * y, "gl"), (lambda y: y / 2, "gl"),
    (lambda y: y + 1.0, "perm"), (torch.nn.LayerNorm(6), "orthogonal_mean"),
    (torch.nn.RMSNorm(6), "orthogonal"),
], ids=["relu", "leaky_relu", "tanh", "sin", "gelu", "silu", "sigmoid", "identity", "scale",
        "div", "shift", "layernorm", "rmsnorm"])
def test_elementwise_kind(act, kind):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3), act

        def forward(self, x):
            return self.b(self.act(self.a(x)))

    m = M()
    r = analyze(m, x_of(B, 4))
    slots = {("a.weight", 0), ("a.bias", 0), ("b.weight", 1)}
    # a norm's gain (and shift) fold into b, which reads it: the normalised axis then takes
    # rotations (fixing 𝟙 for LayerNorm); the certificate checks it
    assert summary(r) == {(kind, 6, 1): slots}
    variance = dict(zip(r.groups[0].params, r.groups[0].variance))
    assert variance[("a.weight", 0)] == "co" and variance[("b.weight", 1)] == "contra"
    if isinstance(act, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        assert [f.gain for f in r.folds] == ["act.weight"]
        with torch.no_grad():
            m.act.weight.uniform_(0.5, 1.5)
        assert r.certify(m) < 1e-9
        unfolded = symgraph.analyze(m, (x_of(B, 4),), fold_norms=False)  # without folding: perms
        norm = {("act.weight", 0)} | ({("act.bias", 0)} if isinstance(act, torch.nn.LayerNorm) else set())
        assert summary(unfolded) == {("perm", 6, 1): slots | norm}


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.g, self.u, self.d = torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.d(torch.relu(self.g(x)) * self.u(x))


def test_gating_product_is_perm():
    r = analyze(Gate(), x_of(B, 4))
    assert summary(r) == {("perm", 6, 1): {("g.weight", 0), ("u.weight", 0), ("u.bias", 0), ("d.weight", 1)}}


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(3, 5)
        self.up, self.down = torch.nn.Linear(5, 7), torch.nn.Linear(7, 5)
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


def test_residual_add_unifies_the_stream():
    r = analyze(Residual(), x_of(B, 3))
    assert summary(r) == {
        ("gl", 5, 1): {("emb.weight", 0), ("emb.bias", 0), ("up.weight", 1), ("down.weight", 0),
                       ("down.bias", 0), ("head.weight", 1)},
        ("scaled_perm", 7, 1): {("up.weight", 0), ("up.bias", 0), ("down.weight", 1)}}


# --- rounding, casts and copies -----------------------------------------------------------
@pytest.mark.parametrize("f", [lambda h: torch.div(h, 0.3, rounding_mode="floor"),
                               lambda h: torch.div(h, 0.3, rounding_mode="trunc"),
                               lambda h: (3 * h).to(torch.int64).to(h.dtype),
                               lambda h: h.bool().to(h.dtype) * h],
                         ids=["floor_div", "trunc_div", "int_cast", "bool_cast"])
def test_rounding_is_nonlinear(f):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.b(f(self.a(x)))

    r = analyze(M(), x_of(B, 4))
    assert [(g.kind, g.size) for g in r.groups] == [("perm", 6)]


def test_functional_copy_takes_the_source():
    """``dst.copy_(src)`` functionalised to ``copy(dst, src)`` has src's values, not dst's."""
    from symgraph.passes import analyze_graph
    from symgraph.report.symmetry import SymmetryReport

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            h.copy_(self.b(x))
            return self.c(h)

    m = M()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = x_of(B, 4)
    ep = torch.export.export(m, (x,), strict=False).run_decompositions({})
    assert "aten.copy.default" in {str(n.target) for n in ep.graph.nodes}
    r = SymmetryReport(analyze_graph(ep), "M", ((x,), {}))
    assert r.certify(m, inputs=(x,)) <= TOL
    by_slot = {p: g for g in r.groups for p in g.params}
    # b's rows flow into c; a's rows are overwritten (a free class of their own)
    assert by_slot[("b.weight", 0)] is by_slot[("c.weight", 1)]
    assert by_slot[("a.weight", 0)] is not by_slot[("c.weight", 1)]

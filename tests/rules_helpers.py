"""Helpers of the per-op rule tests (``test_rules_*.py``): analyse a tiny module with its
certificate checked, seeded inputs, and summaries of the groups found."""
from __future__ import annotations

import torch

import symgraph

TOL = 1e-6
B, S = 2, 5


def analyze(mod, *xs):
    """Analyse ``mod`` on ``xs`` and check the certificate; return the report."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.5)
    report = symgraph.analyze(mod, inputs=tuple(xs))
    assert report.certify(mod, inputs=tuple(xs)) <= TOL
    return report


def x_of(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def summary(report):
    """``{(kind, size, blocks): set of slots}``, asserting no two groups collide."""
    out = {}
    for g in report.groups:
        key = (g.kind, g.size, g.blocks)
        assert key not in out, f"two groups {key}"
        out[key] = set(g.params)
    return out


def structure(report, param, dim):
    """``(kind, part sizes)`` of the class of ``param``'s axis ``dim`` (None: a leaf)."""
    s = report.axis_structure(report.param_axes(param)[dim])
    return None if s is None else (s[0], s[1])

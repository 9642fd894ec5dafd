"""The layout the code promises: a thin package root, the report as the only reader of the
analysis, merge methods as registered files, observation points chosen by the rules."""
from __future__ import annotations

import ast
import copy
import json
import pathlib
import re

import pytest
import torch

import symgraph
from symgraph.merging import MergeMethod, register
from symgraph.passes import registry

from conftest import build_mlp

ROOT = pathlib.Path(symgraph.__file__).parent


def test_package_root_only_reexports():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        assert isinstance(node, ast.Assign), ast.dump(node)[:80]
        assert [t.id for t in node.targets] in (["__all__"], ["__version__"])
    for name in symgraph.__all__:
        assert hasattr(symgraph, name), name
    assert callable(symgraph.transform) and callable(symgraph.merge) and callable(symgraph.align)


def test_only_passes_and_report_read_the_analysis():
    pattern = re.compile(r"_analysis|\.uf\b|\.fibre\b|param_nodes|node_axes")
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("passes/") or rel == "report.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []


def test_modules_stay_small():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > 450} == {}


def test_observation_points_come_from_rule_flags():
    aten = torch.ops.aten
    assert registry.observed(aten.linear.default) and registry.observed(aten.add.Tensor)
    assert registry.observed(aten.convolution.default)
    assert not registry.observed(aten.exp.default) and not registry.observed(aten.view.default)
    model, inputs, _ = build_mlp()
    report = symgraph.analyze(model, inputs)
    targets = {t for _, _, t in report.nodes()}
    hidden = [g for g in report.groups if g.kind != "identity"]
    assert hidden
    for g in hidden:
        pts = report.observation_points(g.id)
        assert pts, g
        for pos, name, dim in pts:
            node_name, op, target = report.nodes()[pos]
            assert node_name == name and op == "call_function" and registry.observed(target)
            assert report.activation_axes(name)[dim] is not None
    assert targets  # the graph was read through the report


def test_alignment_is_keyed_by_group_id_and_serialises():
    model, inputs, _ = build_mlp(seed=1)
    rep = symgraph.analyze(model, inputs)
    t = rep.random_transform(seed=3)
    B = symgraph.transform(model, t)
    al = symgraph.align(model, B, inputs)
    assert set(al.elements) == {g.id for g in rep.groups}
    d = json.loads(al.to_json())
    assert [g["id"] for g in d["groups"]] == [g.id for g in rep.groups]
    for g in d["groups"]:
        # the solved permutation undoes the random one: P_solved = P_random^T
        P = t.elements[g["id"]]
        P = P.dense() if hasattr(P, "dense") else P
        perm = g.get("permutation") or al.elements[g["id"]].co.argmax(-1).tolist()
        assert perm == P.argmax(0).tolist()
        assert g["aligned"] and g["status"].startswith("optimal")


def test_new_merge_method_is_a_registered_class():
    calls = []

    @register("second_only_test")
    class SecondOnly(MergeMethod):
        # keeps the aligned non-anchor model: an output that cannot come from the merge's own
        # copy of the anchor, so it shows that this class's combine produced the model
        def combine(self, states, stats, weights, report):
            calls.append((len(states), [float(w) for w in weights], stats))
            return {k: v.clone() for k, v in states[1].items()}

    assert "second_only_test" in symgraph.merge_methods()
    a, inputs, _ = build_mlp(seed=0)
    b, _, _ = build_mlp(seed=1)
    res = symgraph.merge([a, b], inputs, method="second_only_test", weights=[1, 3])
    assert calls == [(2, [0.25, 0.75], [None, None])]  # called once, normalised weights, no stats
    assert isinstance(res, symgraph.MergeResult) and res.alignments[0] is None
    assert res.alignments[1] is not None and res.timings["total"] >= res.timings["align"] > 0
    aligned_b = res.alignments[1].state(b)
    merged = dict(res.model.named_parameters())
    assert set(merged) == set(aligned_b)
    for k, q in merged.items():
        assert torch.equal(q, aligned_b[k]), k
    assert any(not torch.equal(p, merged[k]) for k, p in a.named_parameters())  # not the anchor
    with torch.no_grad():  # aligned B: B's function in A's basis
        torch.testing.assert_close(res.model(*inputs), b(*inputs), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(res.model(*inputs), a(*inputs), atol=1e-3)
    with pytest.raises(symgraph.InputError, match="unknown method"):
        symgraph.merge([a, copy.deepcopy(b)], inputs, method="no_such_method")


def test_random_permutations_are_index_vectors_and_act_as_before():
    """random_transform keeps unfibred permutations as indices (no n×n matrices) and draws the
    same elements as the dense sampler for the same seed."""
    from symgraph.elements import Perm
    from symgraph.groups import sample
    model, inputs, _ = build_mlp(seed=2)
    rep = symgraph.analyze(model, inputs)
    t = rep.random_transform(seed=7)
    gen = torch.Generator().manual_seed(7)
    for g in rep.groups:
        dense = sample(g.kind, g.dim, gen, batch=rep.fibre_shape(g.id), pairs=g.pairs)
        el = t.elements[g.id]
        if g.kind == "perm":
            assert isinstance(el, Perm) and torch.equal(el.dense(), dense)
        else:
            assert torch.equal(el, dense)
    assert rep.certify(model) < 1e-9
    moved = symgraph.transform(model, t)
    with torch.no_grad():
        torch.testing.assert_close(moved(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)

"""The layout the code promises: a thin package root, the report as the only reader of the
analysis, merge methods as registered files, observation points chosen by the rules."""
from __future__ import annotations

import ast
import copy
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import symgraph
from symgraph.merging import MergeMethod, register
from symgraph.passes import registry

from conftest import build_mlp

ROOT = pathlib.Path(symgraph.__file__).parent


def test_package_root_only_reexports():
    """The root imports its public names lazily (PEP 562): the module ``__getattr__`` and
    ``__dir__``, the table of where each name lives, and the guard that keeps
    ``symgraph.transform`` the function; nothing else."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports only
            assert ast.unparse(node.test) == "TYPE_CHECKING"
            assert all(isinstance(n, ast.ImportFrom) for n in node.body)
            continue
        if isinstance(node, ast.FunctionDef):
            assert node.name in ("__getattr__", "__dir__"), node.name
            continue
        if isinstance(node, ast.ClassDef):
            assert node.name == "_Root"
            continue
        assert isinstance(node, (ast.Assign, ast.AnnAssign)), ast.dump(node)[:80]
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        assert [ast.unparse(t) for t in targets] in (["__all__"], ["_LAZY"], ["sys.modules[__name__].__class__"])
    for name in symgraph.__all__:
        assert hasattr(symgraph, name), name
        assert name in dir(symgraph)
    assert callable(symgraph.transform) and callable(symgraph.merge) and callable(symgraph.align)
    assert set(symgraph._LAZY) | {"__version__"} >= {n for n in symgraph.__all__ if not n.endswith("Error")}


def test_import_symgraph_and_its_command_is_cheap():
    """``import symgraph`` and the console script's module load neither torch nor transformers
    (the script catches a Ctrl-C during those); the public names still resolve on first use."""
    code = ("import sys, symgraph, symgraph.cli, symgraph.cli.entry\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'scipy') if m in sys.modules]\n"
            "assert heavy == [], heavy\n"
            "from symgraph import analyze, transform\n"
            "import symgraph.transform.apply\n"
            "assert symgraph.transform is transform and callable(transform) and callable(analyze)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_only_passes_and_report_read_the_analysis():
    pattern = re.compile(r"_analysis|\.uf\b|\.fibre\b|param_nodes|node_axes")
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("passes/") or rel == "report/symmetry.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []


def test_every_module_opens_with_its_docstring():
    """The docstring comes first (before ``__all__`` and the imports), so ``help()`` and the API
    reference show it."""
    missing = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


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
        def combine_group(self, names, values, stats, weights, report):
            calls.append((tuple(names), len(values), [float(w) for w in weights], stats))
            return {k: values[1][k].clone() for k in names}

    assert "second_only_test" in symgraph.merge_methods()
    a, inputs, _ = build_mlp(seed=0)
    b, _, _ = build_mlp(seed=1)
    res = symgraph.merge([a, b], inputs, method="second_only_test", weights=[1, 3])
    # the engine calls it per group of tensors: every parameter once, normalised weights, no stats
    assert sorted(n for c in calls for n in c[0]) == sorted(k for k, _ in a.named_parameters())
    assert all(c[1:] == (2, [0.25, 0.75], [None, None]) for c in calls)
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
    with pytest.raises(symgraph.InputError, match="method .no_such_method.: is not a merge method; expected one of"):
        symgraph.merge([a, copy.deepcopy(b)], inputs, method="no_such_method")

    class WholeStatesOnly(MergeMethod):  # the former whole-state API: refused in one line
        name = "whole_states_only"

        def combine(self, states, stats, weights, report):
            return states[0]
    with pytest.raises(symgraph.InputError, match="defines no combine_group; expected combine_group"):
        symgraph.merge([a, b], inputs, method=WholeStatesOnly())


def test_random_permutations_are_index_vectors_and_act_as_before():
    """random_transform keeps unfibred permutations as indices (no n×n matrices) and draws the
    same elements as the dense sampler for the same seed."""
    from symgraph.core.elements import Perm
    from symgraph.core.groups import sample
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


#: The stage packages in pipeline order: a module may import from its own package and from
#: packages before it, never after (``errors`` is the floor; the package root and
#: ``__main__`` only re-export / run).
STAGES = ["_version", "errors", "core", "testing", "passes", "transform", "report", "solve", "alignment", "width",
          "checkpoints", "merging", "evaluation", "app", "rotation", "cli"]


def _imports(path: pathlib.Path):
    """``(line, absolute module, names)`` for every ``from ... import`` in a symgraph module."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    pkg = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")
            if base[0] == "symgraph":
                yield node.lineno, base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "symgraph":
                    yield node.lineno, a.name.split("."), []


def _stage(parts):
    """The stage of a module path (``["symgraph", "merging", "run"]`` -> ``merging``)."""
    return parts[1] if len(parts) > 1 else None


def test_top_level_is_the_stage_packages():
    names = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(("_", ".")) and p.name != "__pycache__")
    assert names == sorted([s for s in STAGES if s not in ("errors", "_version")] + ["errors.py", "py.typed"])


def test_imports_point_forward_only():
    order = {s: i for i, s in enumerate(STAGES)}
    backward, private = [], []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("__init__.py", "__main__.py"):
            continue
        own = rel.parts[0].removesuffix(".py")
        for line, parts, names in _imports(path):
            if len(parts) == 1:  # `from symgraph import solve`, `from symgraph import __version__`
                roots = [n for n in names if n not in STAGES and n != "__version__"]
                backward += [f"{rel}:{line} imports {n} from the package root" for n in roots]
                targets, target = {n for n in names if n in STAGES}, None
            else:
                target = _stage(parts)
                targets = {target}
            for t in targets:
                if t != own and order[t] > order[own]:
                    backward.append(f"{rel}:{line}: {own} -> {t}")
            if target != own:
                private += [f"{rel}:{line}: {'.'.join(parts)}.{n}" for n in names if n.startswith("_")
                            and not n.startswith("__")]
    assert backward == []
    assert private == []


def test_no_module_over_450_lines_anywhere():
    sizes = {}
    for d in (ROOT, ROOT.parent / "benchmarks", ROOT.parent / "tests"):
        for p in d.rglob("*.py"):
            sizes[p.relative_to(ROOT.parent).as_posix()] = len(p.read_text().splitlines())
    assert {k: v for k, v in sizes.items() if v > 450} == {}


def test_register_refuses_a_second_rule_for_an_op():
    aten = torch.ops.aten
    key = next(k for k in (aten.relu, aten.relu.default) if k in registry._RULES)
    rule = registry.lookup(key)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(key)(lambda ctx: [])
    assert registry.lookup(key) is rule  # the refused rule did not replace it
    registry.register(key)(rule)  # the same function again is not a duplicate


def test_coverage_lists_the_ops_without_a_rule():
    from symgraph.cli.coverage import unruled_ops
    from symgraph.testing import models
    ops = unruled_ops(models.build("gptj", vocab=64, hidden=16, layers=1, heads=2, positions=32))
    assert all(not registry.has_rule(getattr(torch.ops.aten, k.split(".")[1])) or "." in k for k in ops)
    assert "aten.repeat_interleave.self_int" not in ops  # GPT-J's rotary tables: a constant path, frozen nothing

    class Spectrum(torch.nn.Module):  # an op without a rule (nor a decomposition) on a parameter's values: counted
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.fft.fft(self.lin(x), dim=-1).abs()
    assert sum(k for op, k in unruled_ops(Spectrum(), (torch.randn(2, 4),)).items() if "fft" in op) >= 1
    assert "aten.gather.default" not in unruled_ops(
        models.build("bert", vocab=64, hidden=16, layers=1, heads=2, mlp=32, positions=32))  # has a rule now
    assert unruled_ops(models.build("gpt2", vocab=64, hidden=16, layers=1, heads=2, positions=32)).get(
        "aten.linear.default") is None


def test_merge_config_is_frozen_and_validated_once():
    from pydantic import ValidationError
    from symgraph.app.config import MergeConfig, defaults, merge_options
    cfg = merge_options({"models": ["a", "b"], "out": "o", "weights": [1e308, 1e308]})
    with pytest.raises(ValidationError):
        cfg.align = "none"
    assert defaults()["align"] == "weights" and defaults()["method"] == "average"
    with pytest.raises(symgraph.InputError, match="one mixing weight per model"):
        merge_options({"models": ["a", "b"], "out": "o", "weights": [1.0]})
    assert isinstance(cfg, MergeConfig)


def test_huge_weights_do_not_overflow_into_a_zero_model():
    from symgraph.merging.methods.registry import mixing_weights
    w = mixing_weights([1e308, 1e308], 2)
    assert w.tolist() == [0.5, 0.5]
    with pytest.raises(symgraph.InputError):
        mixing_weights([float("inf"), 1.0], 2)


def test_methods_declare_their_parameters():
    from symgraph.merging.methods.registry import get
    assert set(symgraph.merge_methods()) >= {"average", "fisher", "regmean"}
    assert get("regmean").parameters() == {"alpha": 0.9}
    assert get("average").parameters() == {}
    with pytest.raises(symgraph.InputError, match="no parameter 'beta'"):
        get("regmean", beta=1)


def _module_imports(path: pathlib.Path, modules: set) -> set:
    """The ``symgraph`` modules that the module at ``path`` imports, at any depth (inside
    functions too): ``from . import x`` counts as importing ``x`` when ``x`` is a module, else
    the package it names."""
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    pkg = name.removesuffix(".__init__") if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            out |= subs if len(subs) == len(node.names) else {target} | subs
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & modules


def test_no_import_cycle_counting_imports_inside_functions():
    import networkx as nx
    files = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    for mod, path in files.items():
        graph.add_edges_from((mod, dep) for dep in _module_imports(path, set(files)) if dep != mod)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, cycles


def test_the_report_keeps_its_axis_queries_apart():
    """The user's report (SymmetryReport's own members) and the internal axis queries the
    stages read (its base AxisQueries) are separate: no internal query is defined on the
    report itself, and the documented members are the report's own."""
    from symgraph.report.symmetry import AxisQueries, SymmetryReport
    own = {k for k in vars(SymmetryReport) if not k.startswith("_")}
    queries = {k for k in vars(AxisQueries) if not k.startswith("_")}
    assert own and queries and not own & queries
    assert {"param_axes", "axis_map", "observation_points", "linear_layers", "folds"} <= queries
    assert {"groups", "summary", "certify", "group_of", "random_transform"} <= own | {"groups"}
    api = (ROOT.parent / "docs" / "api.md").read_text()
    line = next(ln for ln in api.splitlines() if "members: [groups" in ln)
    documented = set(line.split("[", 1)[1].rstrip("]").replace(" ", "").split(","))
    assert documented and not documented & queries


def _function_lines(fn) -> int:
    """A function's length as the rule counts it: from its first statement after the docstring
    to its last line (nested functions and classes count in it)."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_no_function_over_60_lines():
    """A longer function is split into named steps that read as the algorithm (issue 61)."""
    sample = ast.parse('def f():\n    """doc\n    string"""\n' + "    x = 1\n" * 61).body[0]
    assert _function_lines(sample) == 61  # the docstring aside
    long = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > 60:
                long[f"{rel}::{node.name}"] = _function_lines(node)
    assert long == {}


def test_no_private_name_imported_across_modules():
    """``from .x import _y`` anywhere, inside functions too, within a stage as across stages
    (issue 61): a helper two modules share is public in one of them, or lives in the module
    that uses it."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for line, parts, names in _imports(path):
            found += [f"{rel}:{line}: {'.'.join(parts)}.{n}" for n in names if n.startswith("_")
                      and not n.startswith("__")]
    assert found == []

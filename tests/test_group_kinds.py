"""The symmetry group kinds are one closed set, :data:`symgraph.core.groups.GroupKind`: every
kind the code compares against (``g.kind == "..."``, ``kind in (...)``) is a member, so a
misspelt kind fails here instead of silently never matching."""
from __future__ import annotations

import ast
import pathlib
from typing import get_args

import symgraph
from symgraph.alignment import checks
from symgraph.core import groups
from symgraph.core.groups import KINDS, PERMUTATION_FAMILY, GroupKind

ROOT = pathlib.Path(symgraph.__file__).parent

#: Other vocabularies that a variable or attribute named ``kind`` holds, by module or package
#: (a path prefix): anything a module compares a ``kind`` against must be a group kind or
#: listed here for a prefix of its path.
OTHER_KINDS = {
    "alignment/": {"single", "family", "fixed-heads"},  # solve units (alignment.sweeps)
    "alignment/saved.py": {"map", "perm-matrix", "matrix"},  # how a saved element is stored
    "merging/circuits.py": {"leaf", "sum", "default"},  # circuit-space layout nodes
    "width/heads.py": {"default"},  # transformers' rope_type of the circuit-space config
    "core/schema.py": {"bool", "negated", "list", "choice", "int", "float", "mapping", "int_or_choice"},  # option types
    "app/options.py": {"bool", "negated", "list", "choice", "int", "float", "mapping", "int_or_choice"},  # their flags
    "checkpoints/specs.py": {"local", "demo", "hub"},  # what a model argument names
    "passes/driver.py": {"sum", "prod"},  # axis structures
    "passes/unionfind.py": {"sum", "prod"},
    "passes/axes.py": {"sum", "prod"},
    "passes/blockmaps.py": {"sum", "prod"},
    "core/distributed.py": {"tensor", "int", "float"},  # values sent between ranks
    "solve/turns.py": {"ValueError"},  # what a solver worker process answered
}


def _is_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kind") or (isinstance(node, ast.Attribute)
                                                                 and node.attr == "kind")


def _strings(node: ast.AST) -> list:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def compared_kinds(source: str) -> list:
    """``(line, literal)`` of every string a ``kind`` (name or attribute) is compared with."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_kind(o) for o in operands):
                out += [(node.lineno, s) for o in operands if not _is_kind(o) for s in _strings(o)]
    return out


def test_kinds_tuple_is_the_literal():
    assert KINDS == get_args(GroupKind)
    assert len(set(KINDS)) == len(KINDS)
    assert symgraph.GroupKind is GroupKind


def test_every_compared_kind_is_a_group_kind():
    unknown, seen = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = set(KINDS).union(*(v for k, v in OTHER_KINDS.items() if rel.startswith(k)))
        for line, s in compared_kinds(path.read_text(encoding="utf-8")):
            seen.add(s)
            if s not in allowed:
                unknown.append(f"{rel}:{line}: {s!r}")
    assert unknown == [], f"not a GroupKind {KINDS} (a typo, or another vocabulary for OTHER_KINDS): {unknown}"
    assert {"perm", "rope", "gl", "orthogonal_mean"} <= seen  # the scan finds the comparisons


def test_a_misspelt_kind_is_caught():
    found = compared_kinds('if g.kind == "orthogonl" or kind in ("perm", "sacled_perm"):\n    pass\n')
    assert [s for _, s in found if s not in KINDS] == ["orthogonl", "sacled_perm"]


def test_kind_tables_use_group_kinds():
    assert set(groups._ORDER) == set(KINDS) and set(groups._SUBGROUPS) == set(KINDS)
    assert all(sub <= set(KINDS) for sub in groups._SUBGROUPS.values())
    assert set(PERMUTATION_FAMILY) <= set(KINDS)
    assert set(checks._KINDS) == set(KINDS)

"""The benchmarks' own layout: no import cycle among their modules (imports inside functions
counted), and the runner knows every benchmark."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

BENCH = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(BENCH.parent).with_suffix("").parts).removesuffix(".__init__")


def imports_of(path: Path, known: set) -> set:
    """The modules of ``known`` that ``path`` imports anywhere in its body (relative imports
    resolved; ``from pkg import mod`` counts ``pkg.mod`` when that is a module)."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in known}


def test_no_import_cycle_among_the_benchmarks():
    files = {module_name(p): p for p in BENCH.rglob("*.py") if "results" not in p.parts}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for mod, path in files.items():
        graph.add_edges_from((mod, dep) for dep in imports_of(path, set(files))
                             if dep != mod and not mod.startswith(dep + "."))
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, cycles

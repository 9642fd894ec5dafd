"""Every dotted ``symgraph.…`` name written in the package (code and docstrings), the tests, the
benchmarks, the docs and the README names something that exists: an importable module or an
attribute of one (a class's field counts). A module moved or renamed leaves no stale name."""
from __future__ import annotations

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?<![\w./-])symgraph(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./~-])symgraph(?:/[A-Za-z_]\w*)+(?:\.py)?")
HERE = pathlib.Path(__file__).resolve()


def _sources() -> list:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for d in ("symgraph", "tests", "benchmarks"):
        files += sorted((ROOT / d).rglob("*.py")) + sorted((ROOT / d).rglob("*.md"))
    return [f for f in files if "results" not in f.relative_to(ROOT).parts and f != HERE]


def _fields(obj) -> set:
    names = set(getattr(obj, "__dataclass_fields__", {})) | set(getattr(obj, "model_fields", {}) or {})
    for klass in getattr(obj, "__mro__", ()):
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute path from the longest importable module."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif isinstance(obj, type) and name in _fields(obj):
                return True  # a field of a dataclass / pydantic model: no class attribute to go on from
            else:
                return False
        return True
    return False


def test_every_dotted_symgraph_name_exists():
    stale = {}
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for m in NAME.finditer(text):
            name = m.group(0)
            if name.endswith(("_py", ".py", ".md", ".json", ".safetensors")):
                continue
            if name not in stale and not resolves(name):
                line = text.count("\n", 0, m.start()) + 1
                stale[name] = f"{path.relative_to(ROOT)}:{line}"
    assert stale == {}, "\n".join(f"{where}: {name}" for name, where in sorted(stale.items()))


def test_every_symgraph_path_exists():
    """``symgraph/passes/trace.py``, ``symgraph/merging/`` as written in prose name real files."""
    missing = {}
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for m in PATH.finditer(text):
            if not (ROOT / m.group(0)).exists() and m.group(0) not in missing:
                missing[m.group(0)] = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
    assert missing == {}, missing


def test_resolver_tells_real_from_stale_names():
    assert resolves("symgraph.analyze") and resolves("symgraph.report.symmetry.SymmetryReport.certify")
    assert resolves("symgraph.Group.kind") and resolves("symgraph.app.config.MergeConfig.align")
    assert not resolves("symgraph.analysis.report") and not resolves("symgraph.shards")
    assert not resolves("symgraph.trace.graph_friendly") and resolves("symgraph.passes.trace.graph_friendly")

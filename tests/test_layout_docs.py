"""The layout as the docs tell it is the layout as it is: every package of ``symgraph/`` is in
the package tree of ``docs/architecture.md`` (and nothing else is), and every package's
docstring names each of its modules and subpackages as ``name`` (and names no module that
does not exist), so that a newcomer reading either finds every file and only files that exist."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "symgraph"


def _packages() -> list:
    return sorted(p.parent for p in PKG.rglob("__init__.py") if "__pycache__" not in p.parts and p.parent != PKG)


def _members(pkg: pathlib.Path) -> set:
    """The modules and subpackages of ``pkg`` (private ones and ``__main__`` aside)."""
    mods = {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")}
    subs = {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    return mods | subs


def _tree() -> str:
    """The package tree of docs/architecture.md: its first ``text`` block under "The package"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The package"):]
    return re.search(r"```text\n(.*?)```", section, re.S).group(1)


def test_the_architecture_page_lists_every_top_level_package_and_only_those():
    tree = _tree()
    listed = set(re.findall(r"^  (\w+)/", tree, re.M))
    top = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert listed == top, (sorted(top - listed), sorted(listed - top))


def test_every_subpackage_is_in_the_tree_under_its_package():
    tree = _tree()
    nested = {p.relative_to(PKG).as_posix() for p in _packages() if len(p.relative_to(PKG).parts) == 2}
    missing = [n for n in nested if not re.search(rf"^\s+{n.split('/')[1]}/", tree, re.M)]
    assert missing == []


def test_every_package_docstring_names_its_modules_and_only_existing_ones():
    missing, phantom = [], []
    for pkg in _packages():
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        named = set(re.findall(r"``(\w+)``", doc))
        members = _members(pkg)
        missing += [f"{pkg.relative_to(PKG)}: {m}" for m in sorted(members - named)]
        # a name in double backticks that looks like a module of the package and is not one
        claimed = {n for n in named if re.fullmatch(r"[a-z_][a-z0-9_]*", n)}
        phantom += [f"{pkg.relative_to(PKG)}: {n}" for n in sorted(claimed - members)
                    if (pkg / f"{n}.py").exists() is False and _looks_like_module(doc, n)]
    assert missing == []
    assert phantom == []


def _looks_like_module(doc: str, name: str) -> bool:
    """Whether ``name`` is used as a module in ``doc``: a bullet's first word (``- ``name`` ...``)."""
    return re.search(rf"^\s*- ``{name}``", doc, re.M) is not None


def test_every_module_path_the_architecture_page_names_exists():
    """Each ``dir/module.py`` the page names in backticks (``engine/plan.py::build_plan`` too) is a
    file of the package: the prose follows the moves."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    files = [p.relative_to(ROOT).as_posix() for d in (PKG, ROOT / "tests", ROOT / "benchmarks") for p in d.rglob("*.py")]
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)(?:::\w+)?`", text))
    assert named, "the page names no module path"
    missing = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert missing == []

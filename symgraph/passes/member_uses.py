"""Where a module's member is used, read from the source (``ast``) of the classes of its holder
and of the modules above it: the uses of one form (a call of it or of its method, an index by a
constant) and whether anything else loads or names it. Shared by the proofs of
:mod:`.closed_reads`; each file is parsed once (cached by its path, size and modification time).
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import re

import torch

from .deadcode import GENERIC, INIT_FUNCTIONS

__all__ = ["torch_own", "torch_based", "named_in", "call_use", "index_use", "uses", "member_sites"]


def torch_own(cls) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "builtins")


def torch_based(cls) -> bool:
    """Whether ``cls`` or a base of it is torch's own, but ``nn.Module`` and ``object``: a
    subclass of ``Sequential`` runs every child in torch's forward, no source read here."""
    return any(torch_own(c) and c not in (torch.nn.Module, object) for c in cls.__mro__)


def named_in(tree, name: str) -> bool:
    """Whether a string constant of ``tree`` (outside init functions; no bare string, a
    docstring, nor a decorator's string of several lines, its prose: ``auto_docstring``'s) names
    ``name`` as a word."""
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    skip = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.name in INIT_FUNCTIONS for n in ast.walk(f)}
    skip |= {id(e.value) for e in ast.walk(tree) if isinstance(e, ast.Expr) and isinstance(e.value, ast.Constant)}
    skip |= {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             for d in f.decorator_list for n in ast.walk(d)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and "\n" in n.value}  # a decorator's prose
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
               and pattern.search(n.value) for n in ast.walk(tree))



def call_use(node, is_h):
    """``self.h(...)`` (method None) or ``self.h.m(...)`` (method ``m``): ``(method, the nodes
    read on)``; None for another form."""
    if isinstance(node, ast.Call) and (is_h(node.func) or (isinstance(node.func, ast.Attribute)
                                                           and is_h(node.func.value))):
        return None if is_h(node.func) else node.func.attr, node.args + [k.value for k in node.keywords]
    return None


def _integer(node) -> int | None:
    """The integer ``node`` writes as a constant (``3``, ``-1``), or None."""
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    ok = isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)
    return sign * node.value if ok else None


def index_use(node, is_h):
    """``self.h[c]`` read, ``c`` an integer constant: ``(c, [])``; None for another form (a
    slice, a computed index, an assignment into the list)."""
    if isinstance(node, ast.Subscript) and is_h(node.value) and isinstance(node.ctx, ast.Load):
        c = _integer(node.slice)
        return None if c is None else (c, [])
    return None


def uses(tree, mine: set, h: str, strict: bool, take=call_use):
    """Each ``(node, function, what)`` where a method of the classes ``mine`` (qualified names)
    of ``tree`` uses ``self.h`` in the form ``take`` reads (:func:`call_use`: ``what`` the
    method called; :func:`index_use`: the index); None where ``h`` is loaded any other way
    outside init functions, or, where ``strict``, a method of those classes reaches members by
    no name (:data:`.deadcode.GENERIC`, ``self`` handed on)."""
    out: list = []

    def mine_h(node, me):
        return isinstance(node, ast.Attribute) and node.attr == h and isinstance(node.value, ast.Name) \
            and me is not None and node.value.id == me

    def walk(node, cls, fn, me):
        if isinstance(node, ast.ClassDef):
            qual = f"{cls}.{node.name}" if cls else node.name
            return all(walk(x, qual, None, None) for x in node.body)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if getattr(node, "name", None) in INIT_FUNCTIONS:
                return True
            args = node.args.posonlyargs + node.args.args
            method = fn is None and cls is not None and not isinstance(node, ast.Lambda) and not any(
                ast.unparse(d) in ("staticmethod", "classmethod") for d in node.decorator_list)  # no instance
            fn, me = (node, args[0].arg if args and method else None) if method else (node, None)
        if mine_h(node, me) and cls not in mine:  # another class's self: another object
            return True
        used = take(node, lambda n: mine_h(n, me))
        if used is not None:
            if cls in mine:
                out.append((node, fn, used[0]))
            return all(walk(x, cls, fn, me) for x in used[1])
        if isinstance(node, ast.Attribute) and node.attr == h:
            return False
        if strict and cls in mine and me is not None:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
                return node.attr not in GENERIC
            if isinstance(node, ast.Name) and node.id == me:
                return False  # self handed on, returned or stored
        return all(walk(x, cls, fn, me) for x in ast.iter_child_nodes(node))
    return out if walk(tree, None, None, None) else None


@functools.lru_cache(maxsize=64)
def _parsed(path: str, size: int, mtime: int):
    """The parsed source of ``path`` (as of its ``size`` and ``mtime``: a changed file is read again)."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _source(cls):
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return path if path and os.path.isfile(path) else None


def member_sites(parent, above, h: str, take=call_use, anywhere: bool = False) -> list | None:
    """The uses of ``parent.h`` of the form ``take`` (calls of it and of its methods, by
    default) in the source of ``parent``'s classes (see :func:`uses`); None where anything
    there or above loads ``h`` otherwise, or a string of the own file of ``parent``'s class or
    of a module's above (``anywhere``: of any file read) names it."""
    classes = [c for c in type(parent).__mro__ if not torch_own(c)]
    files: dict = {}
    own = {_source(type(m)) for m in [*above, parent] if not torch_own(type(m))}
    up = [k for m in above for k in type(m).__mro__ if not torch_own(k)]  # a mixin's methods too
    for c in dict.fromkeys(classes + up):
        path = _source(c)
        if path is None:
            return None
        files.setdefault(path, set()).add(c.__qualname__ if c in classes else None)
    out: list = []
    for path, mine in files.items():
        try:
            st = os.stat(path)
            calls = _file_uses(path, st.st_size, st.st_mtime_ns, frozenset(mine - {None}), h, path in own, take)
            named = (path in own or anywhere) and _named(path, st.st_size, st.st_mtime_ns, h)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return None
        if calls is None or named:
            return None
        out += calls
    return out


@functools.lru_cache(maxsize=1024)
def _file_uses(path: str, size: int, mtime: int, mine: frozenset, h: str, strict: bool, take):
    """:func:`uses` on the file ``path`` as of its ``size`` and ``mtime`` (every parameter under
    one member asks the same: each file is walked once a question)."""
    found = uses(_parsed(path, size, mtime), set(mine), h, strict, take)
    return None if found is None else tuple(found)


@functools.lru_cache(maxsize=1024)
def _named(path: str, size: int, mtime: int, h: str) -> bool:
    return named_in(_parsed(path, size, mtime), h)

"""Parameters their holder reads only on a path every caller closes (issue 65): a static proof
beside :mod:`.deadcode`, over the source (``ast``), running no code.

PI0's action expert is a Gemma model whose forward embeds ``input_ids`` only ``if inputs_embeds is
None``, and PI0 calls it only with ``inputs_embeds=action_embeds``, a required tensor argument of
its own forward: the expert's token embedding is read by no method of the model. For an unread
parameter at ``m1.….mk.p`` take ``H``, a module on the path with a parent ``P`` (each tried,
deepest first), ``h`` its name in ``P`` and ``a`` the path's name after it. It is dead when

- ``H`` is reached under one path only, as is the parameter; neither ``H``'s class nor ``P``'s
  nor any module's above it is torch's own (but for containers above ``P``);
- ``H``'s forward (as its class resolves it, under its decorators) loads ``self.a`` only under
  ``if X is None`` (or the ``else`` of ``if X is not None``), ``X`` one of its arguments that it
  assigns only under such a test (a ``None`` is replaced; a value never becomes ``None``); names
  ``a`` in no string; uses ``self`` only to load attributes that are data of the instance
  (modules, parameters, values in its ``__dict__``: no method or property of its class, which
  could read ``a``), never ``super()`` nor ``self`` handed on;
- in the source files of ``P``'s classes and of the modules above ``P``, outside
  :data:`.deadcode.INIT_FUNCTIONS`, ``h`` is loaded only as ``self.h(...)`` in a method of
  ``P``'s classes, each such call passes ``X=v`` by keyword, ``v`` an argument of the enclosing
  function that has no default, is annotated as a tensor and not as optional, and is never
  assigned there; and no string names ``h``.

As :mod:`.deadcode` does, code that reaches modules without naming them above ``H`` (weight
initialisation, hooks that record outputs, ``enable_input_require_grads``) is taken to run no
computation of theirs, and decorators to hand their arguments on. Anything that cannot be
located or parsed is not proven.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap

import torch

from .deadcode import INIT_FUNCTIONS

__all__ = ["closed_reason", "closed_parameters"]

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _torch_own(cls) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "builtins")


def _words(tree, name: str) -> bool:
    """Whether a string constant of ``tree`` (outside init functions; no bare string, a
    docstring) names ``name`` as a word."""
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    skip = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.name in INIT_FUNCTIONS for n in ast.walk(f)}
    skip |= {id(e.value) for e in ast.walk(tree) if isinstance(e, ast.Expr) and isinstance(e.value, ast.Constant)}
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
               and pattern.search(n.value) for n in ast.walk(tree))


def _none_test(test, names) -> tuple | None:
    """``(X, is_none)`` of a test ``X is None`` (True) or ``X is not None`` (False), ``X`` in ``names``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
            and test.left.id in names and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None and isinstance(test.ops[0], (ast.Is, ast.IsNot)):
        return test.left.id, isinstance(test.ops[0], ast.Is)
    return None


class _Forward(ast.NodeVisitor):
    """What the holder's forward does: ``reads`` of ``self.a`` (each with the arguments known
    None there), ``stores`` of its arguments (likewise), ``members`` loaded on ``self``,
    ``bad`` where ``self`` is used any other way."""

    def __init__(self, fn, attr: str):
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        self.me, self.attr = args[0].arg if args else None, attr
        self.names = {a.arg for a in args[1:]} | {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a}
        self.reads: list = []
        self.stores: list = []
        self.members: set = set()
        self.bad = self.me is None
        self._none: list = []  # per enclosing branch: the argument known None there, or None
        for s in fn.body:
            self.visit(s)

    def _branches(self, node, body, orelse):
        self.visit(node.test)
        t = _none_test(node.test, self.names)
        for part, none in ((body, True), (orelse, False)):
            self._none.append(t[0] if t is not None and t[1] == none else None)
            for x in part if isinstance(part, list) else [part]:
                self.visit(x)
            self._none.pop()

    def visit_If(self, node):
        self._branches(node, node.body, node.orelse)

    def visit_IfExp(self, node):
        self._branches(node, node.body, node.orelse)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == self.me:
            self.members.add(node.attr)
            if node.attr == self.attr:
                self.reads.append({x for x in self._none if x is not None})
            return
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id == self.me:
            self.bad = True  # self handed on, returned or stored
        elif node.id in self.names and not isinstance(node.ctx, ast.Load):
            self.stores.append((node.id, {x for x in self._none if x is not None}))

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "super":
            self.bad = True
        self.generic_visit(node)

    def visit_Expr(self, node):
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            self.generic_visit(node)  # a bare string (a docstring) is never a value

    def visit_Constant(self, node):
        if isinstance(node.value, str) and re.search(rf"(?<![A-Za-z0-9_]){re.escape(self.attr)}(?![A-Za-z0-9_])",
                                                     node.value):
            self.bad = True

    def visit_FunctionDef(self, node):
        self.bad = True  # a function inside: its body runs where it is called

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef


def _parsed_function(fn):
    """``(path, FunctionDef)`` of a plain function's source, or None."""
    fn = inspect.unwrap(fn)
    try:
        path = inspect.getsourcefile(fn)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    node = tree.body[0] if tree.body else None
    return (path, node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _guards(holder, attr: str) -> list | None:
    """The arguments of ``holder``'s forward each read of ``self.attr`` is guarded by (known
    None there), one set a read; None where the forward is not as the module's docstring asks."""
    fn = getattr(type(holder), "forward", None)
    if fn is None or not inspect.isfunction(inspect.unwrap(fn)) or _torch_own(inspect.unwrap(fn)):
        return None
    found = _parsed_function(fn)
    if found is None:
        return None
    f = _Forward(found[1], attr)
    data = set(vars(holder)) | set(holder._modules) | set(holder._parameters) | set(holder._buffers)
    if f.bad or not f.reads or any(not r for r in f.reads) or any(m not in data for m in f.members):
        return None
    guarded = set().union(*f.reads)
    if any(x in guarded and x not in known for x, known in f.stores):
        return None  # an argument a read is guarded by, assigned where it may be a value
    return f.reads


def _not_none(value, fn) -> str | None:
    """The name ``value`` is, where it is an argument of ``fn`` without default, annotated as a
    tensor and not as optional, and never assigned in ``fn``; else None."""
    if not isinstance(value, ast.Name):
        return None
    a = fn.args
    required = a.posonlyargs + a.args
    required = required[:len(required) - len(a.defaults)] + [k for k, d in zip(a.kwonlyargs, a.kw_defaults)
                                                            if d is None]
    arg = next((x for x in required if x.arg == value.id), None)
    note = ast.unparse(arg.annotation) if arg is not None and arg.annotation is not None else ""
    if "Tensor" not in note or "None" in note or "Optional" in note:
        return None
    stored = any(isinstance(n, ast.Name) and n.id == value.id and not isinstance(n.ctx, ast.Load)
                 for n in ast.walk(fn))
    return None if stored else value.id


def _calls(tree, mine: set, h: str):
    """Each ``(call, method)`` of ``self.h(...)`` in a method of the classes ``mine`` (qualified
    names) of ``tree``; None where ``h`` is loaded any other way outside init functions."""
    out: list = []

    def walk(node, cls, fn, me):
        if isinstance(node, ast.ClassDef):
            qual = f"{cls}.{node.name}" if cls else node.name
            for x in node.body:
                if not walk(x, qual, None, None):
                    return False
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if getattr(node, "name", None) in INIT_FUNCTIONS:
                return True
            args = node.args.posonlyargs + node.args.args
            method = fn is None and cls is not None and not isinstance(node, ast.Lambda)
            fn, me = (node, args[0].arg if args and method else None) if method else (node, None)
        own = isinstance(node, ast.Attribute) and node.attr == h and isinstance(node.value, ast.Name) \
            and node.value.id == me and me is not None
        if own and cls not in mine:  # another class's self: another object
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == h:
            v = node.func.value
            if not (isinstance(v, ast.Name) and v.id == me and me is not None):
                return False
            if cls in mine:
                out.append((node, fn))
            return all(walk(x, cls, fn, me) for x in node.args + [k.value for k in node.keywords])
        if isinstance(node, ast.Attribute) and node.attr == h:
            return False
        return all(walk(x, cls, fn, me) for x in ast.iter_child_nodes(node))
    return out if walk(tree, None, None, None) else None


def _tree(path: str):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _source(cls):
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return path if path and os.path.isfile(path) else None


def _passed(parent, above, h: str, args: set) -> bool:
    """Whether every call of ``parent.h`` in its classes' source passes one of ``args`` a value
    that is not None, and nothing else there or above loads or names ``h``."""
    classes = [c for c in type(parent).__mro__ if not _torch_own(c)]
    files: dict = {}
    for c in classes + [type(m) for m in above if not _torch_own(type(m))]:
        path = _source(c)
        if path is None:
            return False
        files.setdefault(path, set()).add(c.__qualname__ if c in classes else None)
    for path, mine in files.items():
        try:
            tree = _tree(path)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return False
        calls = _calls(tree, mine - {None}, h)
        if calls is None or _words(tree, h):
            return False
        for call, fn in calls:
            if not any(k.arg in args and _not_none(k.value, fn) for k in call.keywords):
                return False
    return True


def closed_reason(model, name: str) -> str | None:
    """Why the parameter ``name`` of ``model`` is read by no method (see the module's docstring);
    None where not proven."""
    chain, m, path = [model], model, name.split(".")
    for seg in path[:-1]:
        m = m._modules.get(seg) if isinstance(m, torch.nn.Module) else None
        if m is None:
            return None
        chain.append(m)
    param = chain[-1]._parameters.get(path[-1])
    if param is None or sum(p is param for _, p in model.named_parameters(remove_duplicate=False)) != 1:
        return None
    paths = {id(x): 0 for x in chain}
    for _, x in model.named_modules(remove_duplicate=False):
        if id(x) in paths:
            paths[id(x)] += 1
    for i in reversed(range(1, len(chain))):
        holder, parent, above = chain[i], chain[i - 1], chain[:i - 1]
        if paths[id(holder)] != 1 or _torch_own(type(holder)) or _torch_own(type(parent)) or any(
                _torch_own(type(x)) and not isinstance(x, _CONTAINERS) for x in above):
            continue
        reads = _guards(holder, path[i])
        if reads is None:
            continue
        # every read guarded by an argument each call passes a value: one argument per read suffices
        if all(_passed(parent, above, path[i - 1], r) for r in reads):
            args = " or ".join(sorted(set().union(*reads)))
            return (f"read by {type(holder).__name__}.forward only where {args} is None, which every call "
                    f"of {path[i - 1]} passes a tensor (static check)")
    return None


def closed_parameters(model, names) -> dict:
    """The parameters among ``names`` proven read by no method, each with the proof's reason."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {n: why for n in names if (why := closed_reason(model, n)) is not None}

"""Parameters their holder reads only on a way in that no caller takes (issue 65): a static
proof beside :mod:`.deadcode`, over the source (``ast``).

PI0's action model is a Gemma model whose forward embeds ``input_ids`` only ``if inputs_embeds is
None``, and PI0 calls it only with ``inputs_embeds=action_embeds``, a required tensor argument of
its own forward; Qwen2.5-Omni's audio tower holds an ``audio_bos_eos_token`` that neither its
forward nor the method its caller uses loads (another method reaches its parameters generically,
so :mod:`.deadcode` proves nothing). For an unread parameter at ``m1.….mk.p`` take ``H``, a
module on the path with a parent ``P`` (each tried, deepest first), ``h`` its name in ``P`` and
``a`` the path's name after it. It is dead when

- ``H`` is reached under one path only, as is the parameter; neither ``H``'s class nor ``P``'s
  nor any module's above it is torch's own (but for containers above ``P``);
- in the source files of ``P``'s classes and of the modules' above ``P`` (every class of
  each, its bases and mixins too: VibeVoice's generation mixin decodes audio through its
  tokenizer's ``decode``, which a proof reading only the model's own class missed), outside
  :data:`.deadcode.INIT_FUNCTIONS`, ``h`` is loaded only as ``self.h(...)`` or ``self.h.m(...)``
  in a method of ``P``'s classes (the ways in); no string of the own file of ``P``'s class or of
  a module's above names ``h``, and no method of a class of ``P`` written there reaches members by
  no name (:data:`.deadcode.GENERIC`, ``self`` handed on): as :mod:`.deadcode` reads the modules
  above its holder;
- each way in, ``H``'s forward or method ``m`` as its class resolves it (under its decorators),
  names ``a`` in no string, uses ``self`` only to load data of the instance (modules,
  parameters, values in its ``__dict__``: no method or property, which could read ``a``), never
  ``super()``, ``self`` handed on, nor a function defined inside; a method ``m`` loads ``self.a``
  nowhere, the forward only under ``if X is None`` (or the ``else`` of ``if X is not None``),
  ``X`` an argument it assigns only under such a test (a value never becomes ``None``), where each
  ``self.h(...)`` passes ``X=v`` by keyword, ``v`` an argument of the enclosing function without
  default, annotated as a tensor and not as optional, and never assigned there.

As :mod:`.deadcode` does, code that reaches modules without naming them above ``H`` (weight
initialisation, hooks that record outputs, ``enable_input_require_grads``) is taken to run no
computation of theirs, and decorators to hand their arguments on. Anything that cannot be
located or parsed is not proven.
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import textwrap

import torch

from .deadcode import GENERIC, INIT_FUNCTIONS

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


def _tests(test, names) -> tuple:
    """What each branch of ``test`` knows, ``(body's, else's)``: ``("none", X)`` where ``X`` (in
    ``names``) is None there, ``("set", X)`` where it is not; None for a test of another form."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
            and test.left.id in names and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None and isinstance(test.ops[0], (ast.Is, ast.IsNot)):
        none, x = ("none", test.left.id), ("set", test.left.id)
        return (none, x) if isinstance(test.ops[0], ast.Is) else (x, none)
    return (None, None)


class _Forward(ast.NodeVisitor):
    """What a method of the holder does: ``reads`` of ``self.a`` (each with what its branches
    know, :func:`_tests`), ``stores`` of its arguments (likewise), ``members`` loaded (or
    assigned) on ``self``, ``bad`` where ``self`` is used any other way."""

    def __init__(self, fn, attr: str):
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        self.me, self.attr = args[0].arg if args else None, attr
        self.names = {a.arg for a in args[1:]} | {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a}
        self.reads: list = []
        self.stores: list = []
        self.members: set = set()
        self.bad = self.me is None
        self._known: list = []  # per enclosing branch: what it knows, or None
        for s in fn.body:
            self.visit(s)

    def _here(self) -> frozenset:
        return frozenset(k for k in self._known if k is not None)

    def _branches(self, node, body, orelse):
        self.visit(node.test)
        for part, known in zip((body, orelse), _tests(node.test, self.names)):
            self._known.append(known)
            for x in part if isinstance(part, list) else [part]:
                self.visit(x)
            self._known.pop()

    def visit_If(self, node):
        self._branches(node, node.body, node.orelse)

    def visit_IfExp(self, node):
        self._branches(node, node.body, node.orelse)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == self.me:
            self.members.add(node.attr)
            if node.attr == self.attr:
                self.reads.append(self._here())
            return
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id == self.me:
            self.bad = True  # self handed on, returned or stored
        elif node.id in self.names and not isinstance(node.ctx, ast.Load):
            self.stores.append((node.id, self._here()))

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


def _data(holder, name: str) -> bool:
    """Whether ``self.name`` is data of ``holder``: a module, parameter, buffer or value of the
    instance (no method nor property, which could read anything)."""
    return name in vars(holder) or name in holder._modules or name in holder._parameters or name in holder._buffers


def _guards(holder, method: str, attr: str):
    """``holder``'s ``method`` read (a :class:`_Forward`), where every load of ``self.attr`` in it
    is under a branch that knows something and it uses ``self`` only for data (:func:`_data`);
    else None."""
    fn = getattr(type(holder), method, None)
    if fn is None or not inspect.isfunction(inspect.unwrap(fn)) or _torch_own(inspect.unwrap(fn)):
        return None
    found = _parsed_function(fn)
    if found is None:
        return None
    f = _Forward(found[1], attr)
    if f.bad or any(not r for r in f.reads) or not all(_data(holder, m) for m in f.members):
        return None
    return f


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


def _calls(tree, mine: set, h: str, strict: bool):
    """Each ``(call, function, method)`` of ``self.h(...)`` (method None) or ``self.h.m(...)``
    (method ``m``) in a method of the classes ``mine`` (qualified names) of ``tree``; None where
    ``h`` is loaded any other way outside init functions, or, where ``strict``, a method of those
    classes reaches members by no name (:data:`.deadcode.GENERIC`, ``self`` handed on)."""
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
            method = fn is None and cls is not None and not isinstance(node, ast.Lambda)
            fn, me = (node, args[0].arg if args and method else None) if method else (node, None)
        if mine_h(node, me) and cls not in mine:  # another class's self: another object
            return True
        if isinstance(node, ast.Call) and (mine_h(node.func, me) or (
                isinstance(node.func, ast.Attribute) and mine_h(node.func.value, me))):
            if cls in mine:
                out.append((node, fn, None if mine_h(node.func, me) else node.func.attr))
            return all(walk(x, cls, fn, me) for x in node.args + [k.value for k in node.keywords])
        if isinstance(node, ast.Attribute) and node.attr == h:
            return False
        if strict and cls in mine and me is not None:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
                return node.attr not in GENERIC
            if isinstance(node, ast.Name) and node.id == me:
                return False  # self handed on, returned or stored
        return all(walk(x, cls, fn, me) for x in ast.iter_child_nodes(node))
    return out if walk(tree, None, None, None) else None


def _tree(path: str):
    """The parsed source of ``path``, read again where it changed."""
    st = os.stat(path)
    return _parsed(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _parsed(path: str, size: int, mtime: int):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _source(cls):
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return path if path and os.path.isfile(path) else None


def _sites(parent, above, h: str) -> list | None:
    """The calls of ``parent.h`` and of its methods in the source of ``parent``'s classes (see
    :func:`_calls`); None where anything there or above loads ``h`` otherwise, or a string of
    the own file of ``parent``'s class or of a module's above names it."""
    classes = [c for c in type(parent).__mro__ if not _torch_own(c)]
    files: dict = {}
    own = {_source(type(m)) for m in [*above, parent] if not _torch_own(type(m))}
    up = [k for m in above for k in type(m).__mro__ if not _torch_own(k)]  # a mixin's methods too
    for c in dict.fromkeys(classes + up):
        path = _source(c)
        if path is None:
            return None
        files.setdefault(path, set()).add(c.__qualname__ if c in classes else None)
    out: list = []
    for path, mine in files.items():
        try:
            tree = _tree(path)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return None
        calls = _calls(tree, mine - {None}, h, path in own)
        if calls is None or (path in own and _words(tree, h)):
            return None
        out += calls
    return out


def _holds(known, f, calls) -> str | None:
    """How ``known`` (what a branch knows, :func:`_tests`) is false on every call in ``calls``
    (``(call, function)``), in words; None where it may hold."""
    x = known[1]
    if known[0] != "none" or any(y == x and ("none", x) not in k for y, k in f.stores):
        return None  # an argument assigned where it may be a value
    if not all(any(k.arg == x and _not_none(k.value, fn) for k in call.keywords) for call, fn in calls):
        return None
    return f"{x} is None, which every call passes a tensor"


def _closed(holder, sites, attr: str) -> list | None:
    """Why each load of ``holder.attr`` on the calls ``sites`` is never reached (the forward's
    under a branch every call decides against; another method loads it nowhere); None where not
    proven."""
    why: list = []
    forward = [(call, fn) for call, fn, m in sites if m is None]
    for method in dict.fromkeys(m or "forward" for _, _, m in sites):
        f = _guards(holder, method, attr)
        if f is None or (f.reads and method != "forward"):
            return None
        for r in f.reads:
            found = next((w for k in r if (w := _holds(k, f, forward)) is not None), None)
            if found is None:
                return None
            why.append(found)
    return list(dict.fromkeys(why))


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
        sites = _sites(parent, above, path[i - 1])
        why = _closed(holder, sites, path[i]) if sites else None
        if sites is None or why is None:
            continue
        called = ", ".join(f"{type(holder).__name__}.{m}" for m in dict.fromkeys(m or "forward" for _, _, m in sites))
        if not why:
            return f"loaded by none of {called}, the ways {path[i - 1]} is called (static check)"
        return f"loaded by {called}, the ways {path[i - 1]} is called, only where {' and '.join(why)} (static check)"
    return None


def closed_parameters(model, names) -> dict:
    """The parameters among ``names`` proven read by no method, each with the proof's reason."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {n: why for n in names if (why := closed_reason(model, n)) is not None}

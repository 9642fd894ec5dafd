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
  nor any module's above it is torch's own (but for containers above ``P``), nor a base of
  ``P``'s but ``nn.Module`` (a ``Sequential``'s subclass runs every child in torch's forward);
- in the source files of ``P``'s classes and of the modules' above ``P`` (every class of
  each, its bases and mixins too: VibeVoice's generation mixin decodes audio through its
  tokenizer's ``decode``, which a proof reading only the model's own class missed), outside
  :data:`.deadcode.INIT_FUNCTIONS`, ``h`` is loaded only as ``self.h(...)`` or ``self.h.m(...)``
  in a method of ``P``'s classes (the ways in; ``self.h.forward(...)`` is a call of
  ``self.h``); no string of the own file of ``P``'s class or of
  a module's above names ``h``, and no method of a class of ``P`` written there reaches members by
  no name (:data:`.deadcode.GENERIC`, ``self`` handed on): as :mod:`.deadcode` reads the modules
  above its holder;
- each way in, ``H``'s forward or method ``m`` as its class resolves it (under its decorators),
  names ``a`` in no string, uses ``self`` only to load data of the instance (modules,
  parameters, values in its ``__dict__``, or a name nothing holds, no class included, whose
  load raises: RF-DETR's ``use_mask_token``) or to call a plain method of ``H``'s class (no
  static or class method, no property, none of torch's) that is read the same way and loads
  ``self.a`` nowhere; never ``super()``, ``self`` handed on, nor a function defined inside; a
  method ``m`` loads ``self.a`` nowhere, the forward only where a branch decides against it:
  under ``if X is None`` (or the ``else`` of ``if X is not None``), ``X`` an argument it assigns
  only under such a test (a value never becomes ``None``), where each ``self.h(...)`` passes
  ``X=v`` by keyword, ``v`` an argument of the enclosing function without default, annotated as
  a tensor and not as optional, and never assigned there; or under ``if X is not None`` (or the
  ``else`` of ``if X is None``), ``X`` an argument with default None that it never assigns and
  no ``self.h(...)`` passes (by position or keyword; no ``*`` nor ``**``). An ``and``'s body
  knows what each of its operands' bodies know (RF-DETR's Dinov2 embeddings load the mask
  token under ``if bool_masked_pos is not None and self.use_mask_token``, and their caller passes
  no mask); an ``or``'s ``else`` likewise.

Two more forms, by the same reading of the sources (:mod:`.member_uses`; here a string of any
file read must not name ``h``, a decorator's string of several lines, its prose, excepted):

- no way in at all: ``h`` is loaded nowhere; then ``H`` may be torch's own (PP-DocLayoutV4's
  ``denoising_class_embed``, an embedding its model's forward never loads, the model reaching
  members by no name in transformers' base classes only);
- ``P`` a ``ModuleList`` or ``Sequential`` (torch's class itself: a subclass may index its own
  way; reached under one path only) at ``l`` of a module
  ``O`` whose class is not torch's own, ``H`` its entry ``k``: ``l`` is loaded only as
  ``self.l[c]``, ``c`` an integer constant (``-1`` too), in methods of ``O``'s classes, and no
  ``c`` is ``k`` on the list's length; an iteration, ``zip``, ``len``, a slice, a computed index,
  an assignment into it or the list handed on is another load (PP-DocLayoutV4's decoder reads
  ``self.class_embed[-1]``: its other class heads are dead).

As :mod:`.deadcode` does, code that reaches modules without naming them above ``H`` (weight
initialisation, hooks that record outputs, ``enable_input_require_grads``) is taken to run no
computation of theirs, and decorators to hand their arguments on. Anything that cannot be
located or parsed is not proven.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

import torch

from .deadcode import BranchVisitor, dead_parameters
from .member_uses import index_use, member_sites, torch_based, torch_own

__all__ = ["closed_reason", "closed_parameters", "proven_dead"]

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_LISTS = (torch.nn.Sequential, torch.nn.ModuleList)



def _tests(test, names) -> tuple:
    """What each branch of ``test`` knows, ``(body's, else's)``, each a tuple: ``("none", X)``
    where ``X`` (in ``names``) is None there, ``("set", X)`` where it is not; an ``and``'s body
    knows what each operand's does (an ``or``'s ``else`` likewise), ``not`` swaps them."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _tests(test.operand, names)[::-1]
    if isinstance(test, ast.BoolOp):
        parts = [_tests(v, names) for v in test.values]
        both = tuple(k for b in parts for k in b[0 if isinstance(test.op, ast.And) else 1])
        return (both, ()) if isinstance(test.op, ast.And) else ((), both)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
            and test.left.id in names and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None and isinstance(test.ops[0], (ast.Is, ast.IsNot)):
        none, x = (("none", test.left.id),), (("set", test.left.id),)
        return (none, x) if isinstance(test.ops[0], ast.Is) else (x, none)
    return ((), ())


class _Forward(BranchVisitor):
    """What a method of the holder does: ``reads`` of ``self.a`` (each with what its branches
    know, :func:`_tests`), ``stores`` of its arguments (likewise), ``members`` loaded (or
    assigned) on ``self``, ``bad`` where ``self`` is used any other way."""

    def __init__(self, fn, attr: str):
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        self.me, self.attr, self.fn = args[0].arg if args else None, attr, fn
        self.names = {a.arg for a in args[1:]} | {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a}
        self.reads: list = []
        self.stores: list = []
        self.members: set = set()
        self.bad = self.me is None
        self._under: list = []  # per enclosing branch: what it knows
        for s in fn.body:
            self.visit(s)

    def _here(self) -> frozenset:
        return frozenset(k for ks in self._under for k in ks)

    def _branch_facts(self, test) -> tuple:
        return _tests(test, self.names)

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
    instance (no method nor property, which could read anything), or nothing at all (no class
    has it, torch's ``__getattr__`` finds none: loading it raises, RF-DETR's ``use_mask_token``)."""
    absent = inspect.getattr_static(type(holder), name, _data) is _data \
        and type(holder).__getattr__ is torch.nn.Module.__getattr__ \
        and type(holder).__getattribute__ is object.__getattribute__
    return absent or name in vars(holder) or any(name in d for d in (holder._modules, holder._parameters, holder._buffers))


def _guards(holder, method: str, attr: str):
    """``holder``'s ``method`` read (a :class:`_Forward`), where every load of ``self.attr`` in it
    is under a branch that knows something and it uses ``self`` only for data (:func:`_data`);
    else None."""
    fn = getattr(type(holder), method, None)
    if fn is None or not inspect.isfunction(inspect.unwrap(fn)) or torch_own(inspect.unwrap(fn)):
        return None
    found = _parsed_function(fn)
    if found is None:
        return None
    f = _Forward(found[1], attr)
    if f.bad or any(not r for r in f.reads) or not all(_data(holder, m) or _plain(holder, m, attr, set())
                                                       for m in f.members):
        return None
    return f


def _plain(holder, name: str, attr: str, seen: set) -> bool:
    """Whether ``self.name`` is a plain method of ``holder``'s class (none of torch's, no static
    or class method nor property, no value of the instance over it) that loads ``self.attr``
    nowhere, names it in no string and uses ``self`` only for data (:func:`_data`) or such
    methods (each read once, ``seen``)."""
    if name in seen:
        return True
    seen.add(name)
    fn = inspect.getattr_static(type(holder), name, None)
    if not inspect.isfunction(fn) or torch_own(inspect.unwrap(fn)) or name in vars(holder):
        return False
    found = _parsed_function(fn)
    f = _Forward(found[1], attr) if found is not None else None
    return f is not None and not f.bad and not f.reads and all(
        _data(holder, m) or _plain(holder, m, attr, seen) for m in f.members)


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



def _holds(known, f, calls) -> str | None:
    """How ``known`` (what a branch knows, :func:`_tests`) is false on every call in ``calls``
    (``(call, function)``), in words; None where it may hold."""
    x = known[1]
    if known[0] == "set":
        return f"{x} is not None, which no call passes" if _left_none(f, x, calls) else None
    if any(y == x and ("none", x) not in k for y, k in f.stores):
        return None  # an argument assigned where it may be a value
    if not all(any(k.arg == x and _not_none(k.value, fn) for k in call.keywords) for call, fn in calls):
        return None
    return f"{x} is None, which every call passes a tensor"


def _left_none(f, x: str, calls) -> bool:
    """Whether the argument ``x`` of the forward ``f`` read is None on every call of ``calls``:
    its default is None, the forward never assigns it, and no call passes it (by position or
    keyword; no ``*`` or ``**`` in any)."""
    a = f.fn.args
    pos = a.posonlyargs + a.args
    defaults = dict(zip([p.arg for p in pos[len(pos) - len(a.defaults):]], a.defaults))
    defaults |= {k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    default = defaults.get(x)
    if not (isinstance(default, ast.Constant) and default.value is None) or any(y == x for y, _ in f.stores):
        return False
    at = next((i for i, p in enumerate(pos) if p.arg == x), None)  # the instance's at 0
    return all(not any(isinstance(v, ast.Starred) for v in call.args)
               and all(k.arg not in (None, x) for k in call.keywords)
               and (at is None or len(call.args) < at) for call, _ in calls)


def _closed(holder, sites, attr: str) -> list | None:
    """Why each load of ``holder.attr`` on the calls ``sites`` is never reached (the forward's
    under a branch every call decides against; another method loads it nowhere); None where not
    proven."""
    why: list = []
    forward = [(call, fn) for call, fn, m in sites if m in (None, "forward")]  # self.h.forward(...) too
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
        if paths[id(holder)] != 1 or any(torch_own(type(x)) and not isinstance(x, _CONTAINERS) for x in above):
            continue
        if type(parent) in _LISTS and i >= 2 and path[i - 1].isdigit() and paths[id(parent)] == 1:
            why = _unindexed(chain[i - 2], chain[:i - 2], path[i - 2], len(parent), int(path[i - 1]))
        else:
            why = _member(holder, parent, above, path[i - 1], path[i])
        if why is not None:
            return why
    return None


def _member(holder, parent, above, h: str, a: str) -> str | None:
    """Why ``parent``'s member ``h`` (``holder``) never loads its own ``a`` (the module's
    docstring); None where not proven."""
    if torch_own(type(parent)) or torch_based(type(parent)):
        return None
    sites = member_sites(parent, above, h)
    if sites == [] and member_sites(parent, above, h, anywhere=True) == []:
        return f"{h} is loaded by no method of {type(parent).__name__} nor above it (static check)"
    why = _closed(holder, sites, a) if sites and not torch_own(type(holder)) else None
    if why is None or not sites:
        return None
    called = ", ".join(f"{type(holder).__name__}.{m}" for m in dict.fromkeys(m or "forward" for _, _, m in sites))
    if not why:
        return f"loaded by none of {called}, the ways {h} is called (static check)"
    return f"loaded by {called}, the ways {h} is called, only where {' and '.join(why)} (static check)"


def _unindexed(owner, above, h: str, size: int, k: int) -> str | None:
    """Why entry ``k`` of ``owner``'s list ``h`` (of ``size`` entries) is never read: every
    load of ``h`` is ``self.h[c]``, ``c`` an integer constant other than ``k`` (see the module's
    docstring); None where not proven."""
    if torch_own(type(owner)) or torch_based(type(owner)):
        return None
    sites = member_sites(owner, above, h, index_use, anywhere=True)
    if sites is None:
        return None
    read = sorted({c % size for _, _, c in sites if -size <= c < size})
    if k in read:
        return None
    at = ", ".join(map(str, read)) or "no index"
    return f"{h} is read only at {at}, by constant indices in {type(owner).__name__} (static check)"


def closed_parameters(model, names) -> dict:
    """The parameters among ``names`` proven read by no method, each with the proof's reason."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {n: why for n in names if (why := closed_reason(model, n)) is not None}


def proven_dead(model, names) -> dict:
    """The parameters among ``names`` proven dead, by :mod:`.deadcode` or by these proofs
    (for those :mod:`.deadcode` leaves), each with its reason."""
    dead = dead_parameters(model, names)
    return {**closed_parameters(model, [n for n in names if n not in dead]), **dead}

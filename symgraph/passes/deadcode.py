"""Parameters dead in their model's own source: a conservative, static proof (``ast`` over the
source files of the module classes, never running any code).

An unread parameter (:func:`.nodes.unread_parameters`) is in general read by code the trace did
not take (another input kind, another method), so the analysis fixes every parameter. Some are
read by nothing: MarkupLM's ``xpath_unitseq2_embeddings``, an ``nn.Linear`` its ``__init__``
assigns and no method calls. For such a parameter at ``m1.….mk.p`` take ``M``, a module on the
path whose class is not torch's own (each tried, deepest first: Wav2Vec2-Conformer's encoder
never calls its ``pos_conv_embed``, whose own forward reads its convolution), and ``a``, the
path's name after it (the attribute leading to the parameter, or the parameter). It is dead
when, in every source file
defining the class of ``M`` or a base of it (torch's classes excluded) or the class of a module
above ``M``, outside ``__init__`` and weight-initialisation functions (``INIT_FUNCTIONS``):

- ``a`` is never loaded as an attribute (``x.a``; ``self.a`` counts only in methods of ``M``'s
  classes, since elsewhere ``self`` is another object), augmented or deleted, and is a word of no
  string constant (``getattr``, ``_modules["a"]``, key maps: ``"a"``, ``"x.a.weight"``; not
  ``"hidden_a"``); a load of ``self.a`` under a branch that ``M``'s own attributes decide against
  does not count (``if self.stride != 2: self.act(x)`` in a block of stride 2: a number or string in
  the instance's ``__dict__``, assigned only in ``__init__``); ``X.a = y.a``, ``y`` an argument
  of the function, only moves a tensor into a slot named ``a`` (Reformer's
  ``set_output_embeddings``) and is no read;
- ``M``'s classes never reach their members by a name not written there: ``self.children()``,
  ``self.parameters()``, ``self._modules``, ``self.__dict__`` (``GENERIC``), ``getattr(self,
  name)`` with a computed name, ``self`` handed on, returned or stored, a ``__getattr__`` of
  their own; ``self`` handed to a module-level function is allowed where that function's own
  source, read the same way with the argument as its ``self``, reaches no member but by names
  other than ``a`` and hands it on to nothing (``is_fsdp_managed_module(self)``);
- ``a`` is no position in a list, ``M`` no ``Sequential``/``ModuleList``/``ModuleDict``, no
  base of ``M`` a torch layer (its forward reads ``weight`` by name) and no module above ``M``
  a torch module other than those containers.

Anything that cannot be located or parsed is not proven. Each file is parsed once (cached by
its path, size and modification time).
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import re

import torch

__all__ = ["DEAD", "BranchVisitor", "dead_parameters", "dead_reason", "split_dead"]

DEAD = "symgraph_dead"  # graph meta: unread parameters proven dead -> the proof's reason

#: functions that only initialise weights or build the module: their reads are not the model's
INIT_FUNCTIONS = frozenset({"__init__", "_init_weights", "init_weights", "_initialize_weights"})
#: attributes and methods that reach a module's children or parameters without naming them
GENERIC = frozenset({"children", "named_children", "modules", "named_modules", "parameters",
                     "named_parameters", "buffers", "named_buffers", "_modules", "_parameters",
                     "_buffers", "__dict__", "apply", "state_dict", "get_submodule", "get_parameter",
                     "__getattr__", "__getattribute__"})
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


class BranchVisitor(ast.NodeVisitor):
    """An AST visitor visiting each branch of an ``if`` (statement or expression) under what
    its condition says: ``_branch_facts(test)`` gives the body's and the ``else``'s entry,
    held on the stack ``self._under`` while that branch is visited."""

    def _branch_facts(self, test) -> tuple:
        raise NotImplementedError

    def _branches(self, node):
        self.visit(node.test)
        for part, fact in zip((node.body, node.orelse), self._branch_facts(node.test)):
            self._under.append(fact)
            for x in part if isinstance(part, list) else [part]:
                self.visit(x)
            self._under.pop()

    visit_If = visit_IfExp = _branches


class _Facts(BranchVisitor):
    """What one source file does with attribute names: ``loads`` maps a name to the classes
    whose ``self`` it is loaded on (None: any other receiver), ``words`` holds the string
    constants, ``generic`` the classes reaching their children generically, ``classes`` every
    class's qualified name."""

    def __init__(self):
        self.loads: dict = {}
        self.words: list = []
        self.generic: set = set()
        self.handed: dict = {}  # class -> {(function name, position)}: f(self) with f a plain name
        self._calls: list = []  # (class, function name, position, the enclosing functions' names)
        self.classes: set = set()
        self.guarded: dict = {}  # name -> [(class, guards)]: self.name loaded only under guards
        self.stored: set = set()  # (class or None: another receiver, attribute) assigned outside __init__
        self._under: list = []  # the enclosing function's branch conditions: (attribute, op, constant, taken)
        self._scope: list = []  # ('class', qualname) or ('def', name, self name, class, arguments, bound names)

    def _where(self):
        """The innermost function's (self name, class qualname): a method's own, inherited by
        the functions inside it; (None, None) outside methods."""
        s = next((s for s in reversed(self._scope) if s[0] == "def"), None)
        return (s[2], s[3]) if s else (None, None)

    def _skipped(self) -> bool:
        return any(s[0] == "def" and s[1] in INIT_FUNCTIONS for s in self._scope)

    def visit_ClassDef(self, node):
        outer = next((s[1] for s in reversed(self._scope) if s[0] == "class"), None)
        qual = f"{outer}.{node.name}" if outer else node.name
        self.classes.add(qual)
        self._scope.append(("class", qual))
        self.generic_visit(node)
        self._scope.pop()

    def visit_FunctionDef(self, node):
        parent = self._scope[-1] if self._scope else None
        static = any(ast.unparse(d) in ("staticmethod", "classmethod") for d in node.decorator_list)
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        if parent and parent[0] == "class":  # a method: its first argument is the instance
            me, cls = (args[0].arg, parent[1]) if args and not static else (None, None)
            if me is not None and node.name in ("__getattr__", "__getattribute__"):
                self.generic.add(cls)
            self._function(node, node.name, args, me, cls)
        else:
            self._inner(node, node.name, args)

    def visit_Lambda(self, node):
        self._inner(node, "<lambda>", node.args.posonlyargs + node.args.args + node.args.kwonlyargs)

    def _inner(self, node, name, args):
        """A function that is no method inherits the enclosing method's ``self``, unless an
        argument of its own takes that name (a hook's ``self``): another object, whose
        attributes count as any receiver's."""
        me, cls = self._where()
        self._function(node, name, args, *(("", None) if me in {a.arg for a in args} else (me, cls)))

    def _function(self, node, name, args, me, cls):
        self._scope.append(("def", name, me, cls, {a.arg for a in args} - {me}, {a.arg for a in args}))
        outer, self._under = self._under, []  # a function's body runs wherever it is called
        self.generic_visit(node)
        self._under = outer
        self._scope.pop()

    def _guard(self, test):
        """``(attribute, op, constant)`` of a branch test ``self.x OP c`` (``==``, ``!=``, ``is``,
        ``is not``, ``<``...), ``self.x`` or ``not self.x`` (op ``bool``); None for any other."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            g = self._guard(test.operand)
            return None if g is None or g[1] != "bool" else (g[0], "not", None)
        if isinstance(test, ast.Attribute) and self._mine(test.value):
            return (test.attr, "bool", None)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Attribute) \
                and self._mine(test.left.value) and isinstance(test.comparators[0], ast.Constant):
            return (test.left.attr, type(test.ops[0]).__name__, test.comparators[0].value)
        return None

    def _branch_facts(self, test) -> tuple:
        """Each branch's guard: the condition's (attribute, op, constant) and whether taken."""
        g = self._guard(test)
        return tuple(None if g is None else (*g, taken) for taken in (True, False))

    visit_AsyncFunctionDef = visit_FunctionDef

    def _mine(self, node) -> bool:
        """Whether ``node`` is the innermost method's ``self`` (or ``super()``)."""
        me, _ = self._where()
        return (isinstance(node, ast.Name) and node.id == me) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")

    def _reach(self):
        """The innermost method's class reaches its members by no name this file shows."""
        _, cls = self._where()
        if cls is not None and not self._skipped():
            self.generic.add(cls)

    def _load(self, node):
        _, cls = self._where()
        guards = tuple(g for g in self._under if g is not None)
        if guards and cls is not None and self._mine(node.value):
            self.guarded.setdefault(node.attr, []).append((cls, guards))
            return
        self.loads.setdefault(node.attr, set()).add(cls if self._mine(node.value) else None)

    def visit_Attribute(self, node):
        if not self._skipped():
            if node.attr in GENERIC and self._mine(node.value):
                self._reach()
            if not isinstance(node.ctx, ast.Store):
                self._load(node)
            else:
                _, cls = self._where()
                self.stored.add((cls if self._mine(node.value) else None, node.attr))
        if not self._mine(node.value):  # self.x: the receiver is no bare use of self
            self.visit(node.value)

    def _bind(self, name: str):
        """``name`` bound in the innermost function (an assignment, a loop, an import)."""
        s = next((s for s in reversed(self._scope) if s[0] == "def"), None)
        if s is not None:
            s[5].add(name)

    def visit_Import(self, node):
        for a in node.names:
            self._bind((a.asname or a.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store):
            self._bind(node.id)
        me, _ = self._where()
        if node.id == me:  # self handed on, returned or stored: what reads it is not here
            self._reach()

    def visit_Assign(self, node):
        """``X.a = y.a``, ``y`` an argument of the function: a tensor moved into a slot ``a``
        (Reformer's ``set_output_embeddings``), no read of one."""
        for t in node.targets:
            self.visit(t)
        v, fn = node.value, next((s for s in reversed(self._scope) if s[0] == "def"), None)
        moved = (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and fn is not None
                 and v.value.id in fn[4] and all(isinstance(t, ast.Attribute) and t.attr == v.attr
                                                  for t in node.targets))
        if not moved:
            self.visit(v)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Attribute) and not self._skipped():
            self._load(node.target)
        self.generic_visit(node)

    def visit_Expr(self, node):
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            self.generic_visit(node)  # a bare string (a docstring) is never a value

    def visit_Constant(self, node):
        if isinstance(node.value, str) and not self._skipped():
            self.words.append(node.value)

    def visit_Call(self, node):
        """``self(x)``, ``isinstance(self, C)``, ``getattr(self, "a")``: no reach past a name;
        ``getattr(self, name)`` with a computed name, ``f(self)``: a reach."""
        func = node.func.id if isinstance(node.func, ast.Name) else None
        named = func in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 \
            and isinstance(node.args[1], ast.Constant)
        quiet = func in ("isinstance", "super", "type", "id") or named
        if not self._mine(node.func):
            self.visit(node.func)
        _, cls = self._where()
        for i, a in enumerate(node.args):
            if self._mine(a) and func is not None and not quiet and cls is not None and not self._skipped():
                names = [s[5] for s in self._scope if s[0] == "def"]  # complete once the file is read
                self._calls.append((cls, func, i, names))  # checked where it goes: see finish
            elif not (quiet and self._mine(a)):
                self.visit(a)
        for k in node.keywords:
            if not (quiet and self._mine(k.value)):
                self.visit(k.value)


    def finish(self):
        """Each ``f(self)`` seen: ``f`` a module-level function (to be read where it goes,
        ``handed``) unless a function around the call binds the name, then a reach."""
        for cls, func, i, names in self._calls:
            if any(func in n for n in names):
                self.generic.add(cls)
            else:
                self.handed.setdefault(cls, set()).add((func, i))
        self._calls = []
        return self


@functools.lru_cache(maxsize=8)
def _tree(path: str, size: int, mtime: int):
    """The parsed source of ``path`` (as of its ``size`` and ``mtime``: a changed file is read
    again), shared by the class facts and the functions ``self`` is handed to."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


@functools.lru_cache(maxsize=256)
def _parsed(path: str, size: int, mtime: int):
    facts = _Facts()
    facts.visit(_tree(path, size, mtime))
    return facts.finish()


def _facts(path: str):
    st = os.stat(path)
    return _parsed(path, st.st_size, st.st_mtime_ns)


def _handed_safely(cls, name: str, pos: int, attr: str) -> bool:
    """Whether the plain function ``name`` that ``cls``'s methods hand their ``self`` to (at
    position ``pos``) reaches no member of it but by names other than ``attr``
    (``is_fsdp_managed_module(self)`` asks ``isinstance`` and a named ``getattr``): its own
    source, parsed as a method whose ``self`` is that argument; a function handing it on again
    is not followed."""
    import sys
    fn = getattr(sys.modules.get(cls.__module__), name, None)
    where = _source(fn) if inspect.isfunction(fn) and "." not in fn.__qualname__ else None
    if where is None:
        return False
    st = os.stat(where[0])
    try:
        facts = _callee(where[0], st.st_size, st.st_mtime_ns, where[1], pos)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    return facts is not None and not facts.generic and not facts.handed and attr not in facts.loads \
        and not _named(attr, facts.words)


@functools.lru_cache(maxsize=256)
def _callee(path: str, size: int, mtime: int, name: str, pos: int):
    """What the module-level function ``name`` of ``path`` does with its argument at ``pos``
    (a :class:`_Facts`, that argument its ``self``), or None where it has none there."""
    node = next((n for n in _tree(path, size, mtime).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None or pos >= len(node.args.posonlyargs + node.args.args):
        return None
    args = node.args.posonlyargs + node.args.args
    facts = _Facts()
    facts._function(node, name, node.args.posonlyargs + node.args.args + node.args.kwonlyargs,
                    args[pos].arg, "<callee>")
    return facts.finish()


def _source(cls):
    """(file, qualname) where ``cls`` is written, or None."""
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return (path, cls.__qualname__) if path and os.path.isfile(path) else None


def _torch_own(cls) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "builtins")


def _holders(model, path: list) -> list:
    """Each (modules above the holder, the holder, the name after it) on ``path``, the holder
    any module on it whose class is not torch's own, deepest first: a submodule no method
    reaches (Wav2Vec2-Conformer's ``pos_conv_embed``, built and never called) leaves every
    parameter under it unread, whatever the classes below it do."""
    chain, m = [model], model
    for seg in path[:-1]:
        m = m._modules.get(seg) if isinstance(m, torch.nn.Module) else None
        if m is None:
            return []
        chain.append(m)
    return [(chain[:i], chain[i], path[i]) for i in reversed(range(len(chain)))
            if not _torch_own(type(chain[i]))]


def dead_reason(model, name: str) -> str | None:
    """Why the parameter ``name`` of ``model`` is never read by any method (None: not proven)."""
    for above, holder, attr in _holders(model, name.split(".")):
        why = _unreached(above, holder, attr)
        if why is not None:
            return why
    return None


def _unreached(above, holder, attr) -> str | None:
    """Why ``holder``'s member ``attr`` is never reached by any method (None: not proven)."""
    if attr.isdigit() or isinstance(holder, _CONTAINERS) or any(  # torch's layers read by name
            _torch_own(c) and c not in (torch.nn.Module, object) for c in type(holder).__mro__) or any(
            _torch_own(type(m)) and not isinstance(m, _CONTAINERS) for m in above):
        return None
    mro = [_source(c) for c in type(holder).__mro__ if not _torch_own(c)]
    outer = [_source(type(m)) for m in above if not _torch_own(type(m))]
    if any(s is None for s in mro + outer):
        return None
    try:
        facts = {p: _facts(p) for p, _ in mro + outer}
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    if any(q not in facts[p].classes or q in facts[p].generic for p, q in mro):
        return None
    classes = [c for c in type(holder).__mro__ if not _torch_own(c)]
    if not all(_handed_safely(c, f, i, attr) for c, (p, q) in zip(classes, mro)
               for f, i in facts[p].handed.get(q, ())):
        return None
    for p, f in facts.items():
        mine = {q for pp, q in mro if pp == p}
        if any(c is None or c in mine for c in f.loads.get(attr, ())) or _named(attr, f.words):
            return None
        if any(c in mine and not _not_taken(holder, guards, facts.values(), {q for _, q in mro})
               for c, guards in f.guarded.get(attr, ())):
            return None
    files = ", ".join(dict.fromkeys(os.path.basename(p) for p, _ in mro + outer))
    return f"never read by any method of {files} (static check)"


_OPS = {"Eq": lambda a, b: a == b, "NotEq": lambda a, b: a != b, "Is": lambda a, b: a is b,
        "IsNot": lambda a, b: a is not b, "Lt": lambda a, b: a < b, "LtE": lambda a, b: a <= b,
        "Gt": lambda a, b: a > b, "GtE": lambda a, b: a >= b,
        "bool": lambda a, _: bool(a), "not": lambda a, _: not a}


def _named(attr: str, words) -> bool:
    """Whether a string constant names ``attr``: as a whole word of it (``"act"``,
    ``"layers.0.act.weight"``), not inside another name (``"hidden_act"``, ``"activation"``)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(attr)}(?![A-Za-z0-9_])")
    return any(pattern.search(w) for w in words)


#: attributes torch's own methods set after ``__init__`` (``train()``/``eval()``): never decided
_TORCH_STATE = frozenset(vars(torch.nn.Module()))


def _not_taken(holder, guards, facts, classes) -> bool:
    """Whether one of a load's branch conditions is decided against it by ``holder``'s own
    attributes (PP-LCNetV3's ``if self.stride != 2: self.act(...)`` in a block of stride 2): a
    number or string in the instance's ``__dict__`` (nothing runs to read it; not a flag, which
    code elsewhere may switch: ``gradient_checkpointing``),
    assigned only in ``__init__`` (no method of its ``classes`` stores it, nor any code on another
    receiver) and named by no string."""
    for name, op, const, taken in guards:
        value = vars(holder).get(name, _OPS)
        if value is _OPS or name in _TORCH_STATE or isinstance(value, bool) or not isinstance(value, (int, float, str)) or any(
                (None, name) in f.stored or any((c, name) in f.stored for c in classes) or _named(name, f.words)
                for f in facts):
            continue
        try:
            if bool(_OPS[op](value, const)) != taken:
                return True
        except (KeyError, TypeError):
            continue
    return False


def dead_parameters(model, names) -> dict:
    """The parameters among ``names`` proven dead, each with the proof's one-line reason."""
    if not isinstance(model, torch.nn.Module):
        return {}
    out = {}
    for name in names:
        why = dead_reason(model, name)
        if why is not None:
            out[name] = why
    return out


def split_dead(unread, meta) -> tuple:
    """``unread`` less the parameters proven dead (``meta[DEAD]``, kept by :func:`.trace.trace`),
    and those, each with its reason."""
    dead = {n: why for n, why in meta.get(DEAD, {}).items() if n in unread}
    return [n for n in unread if n not in dead], dead

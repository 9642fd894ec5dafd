"""Optional arguments of a parameter's own holder (issue 65): a module the forward calls but
never hands the optional tensor argument that makes it read a parameter (an image model's
embeddings called without ``bool_masked_pos``, so its mask token stays unread; a speech
encoder's prenet called without ``mask_time_indices``; the first of DPT's fusion layers, called
with no ``residual``, whose residual layer no input ever reaches). A parameter the traced
program never reads fixes every class, so the trace also runs the holder on the argument.

Which holder and which argument are found by trial runs that observe the parameters read
(:func:`.optional_inputs.parameter_reads`), keyed on the forward's signature, never on names:
for an unread parameter, each module above it (nearest first, the model itself excluded: its
optional inputs are :mod:`.optional_inputs`') that the forward calls with an optional argument
(default ``None``, annotated as a tensor) left unset; one run of the forward records each such
call; a switch off by default (``fine: bool = False``) is tried on. The values tried for a
tensor, in order: each floating tensor the holder is called with (a fusion
layer's residual is a tensor of its input's shape), then a boolean mask, every third entry set
(as :func:`.optional_inputs.masked_patches`), of the shape of each tensor the holder or one of
its children takes or returns (of three axes or more), less its last axis. One is kept where
the holder, run alone on its recorded call with the value set, reads a parameter under it that
was unread, and returns a finite result of its output's form (:data:`MAX_TRIALS` such runs):
a tensor of the same shape, or where none has one, a longer one whose leading part is taken
(Granite-Docling's fine path: four times the tokens).

The holder then runs twice in the program: as the forward calls it, and on the argument; the
second result ``r`` is added to the first as ``0 * r``. The program computes the plain forward
(exactly, where ``r`` is finite), so its consumers (alignment by activations, REPAIR, the
statistics, widen) run it on a user's batch and see the model's own values; the analysis reads
the holder's second run too, and a symmetry it finds must keep that run's values in step as
well: more constraints, never fewer, so every claim holds of the plain forward.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .entry_points import entered, entry_points
from .nodes import unread_parameters
from .optional_inputs import float_leaves, forward_hooks, parameter_reads
from .training_runs import trained, training_runs

__all__ = ["HOLDERS", "Injection", "holder_injections", "injected", "substituted", "traced_with_holders",
           "MAX_TRIALS"]

MAX_TRIALS = 24  # trial runs at most per trace (each one runs the whole forward)
HOLDERS = "symgraph_holders"  # graph meta: the injections the program was traced under


@dataclass(frozen=True)
class Injection:
    """The holder at ``path`` run again with ``arg`` set: True (``flag``: a switch left off),
    the ``index``-th floating tensor it is called with (``shape`` None), else a boolean mask of
    ``shape``."""
    path: str
    arg: str
    index: int | None = None
    shape: tuple | None = None
    flag: bool = False

    def value(self, call: list):
        """The argument for a call whose floating tensors are ``call``."""
        if self.flag:
            return True
        if self.shape is None:
            assert self.index is not None  # one of the two is set
            return call[self.index]
        n = self.shape[-1]
        dev = call[0].device if call else None
        return (torch.arange(n, device=dev) % 3 == 1).expand(*self.shape)


def _optional_tensors(module) -> list[str]:
    """The arguments of ``module.forward`` that are optional tensors: default ``None``, and an
    annotation that names a tensor."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items() if p.default is None and "Tensor" in str(p.annotation)]


def _flags(module) -> list[str]:
    """The arguments of ``module.forward`` that are switches, off by default: ``x: bool = False``
    (Granite-Docling's connector takes its fine path on ``fine=True``)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items() if p.default is False and "bool" in str(p.annotation)]


def _unset(bound, arg: str, flag: bool) -> bool:
    """Whether the call left ``arg`` as the injection finds it: None, or a switch off."""
    value = bound.arguments.get(arg)
    return value is None or (flag and value is False)


def _bound(module, args, kwargs):
    """``args``/``kwargs`` bound to ``module.forward``'s signature, or None where they do not bind."""
    try:
        return inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None


def _matched(mine: list, theirs: list) -> list:
    """Per leaf of two outputs' forms, the slices of the second's tensor that meet the first's:
    all of it where they have one shape; else, where none has, its leading part along the axes
    where it is longer (a path with four times as many tokens: sequence axes, which no symmetry
    moves, and the analysis constrains whatever a slice meets); None for a leaf not matched."""
    same = [() if x is not None and x == y else None for x, y in zip(mine, theirs)]
    if any(m is not None for m in same):
        return same
    return [tuple(slice(0, k) for k in x[0]) if x is not None and y is not None and x[1] == y[1]
            and len(x[0]) == len(y[0]) and all(k <= j for k, j in zip(x[0], y[0])) else None
            for x, y in zip(mine, theirs)]


def _joined(out, extra, replace: bool = False):
    """``out`` with ``0 * x`` added to each floating tensor ``x`` of ``extra`` that meets one of
    it (:func:`_matched`; the same structure; ``replace``: ``x`` in its place), or None where
    none does."""
    (spec, mine), (other_spec, theirs) = _form(out), _form(extra)
    cut = _matched(mine, theirs)
    if spec != other_spec or all(c is None for c in cut):
        return None
    a, b = tree_flatten(out)[0], tree_flatten(extra)[0]
    return tree_unflatten([x if c is None else (y[c] if replace else x + 0 * y[c]) for x, y, c in zip(a, b, cut)],
                          spec)


class _Hook:
    """The forward hook running a holder again on its injected argument (see the module's
    docstring); ``joined`` counts the runs whose result reached the holder's output (added as
    ``0 *`` it, or in its place where ``replace``)."""

    def __init__(self, injection: Injection, replace: bool = False):
        self.injection, self.inside, self.joined, self.replace = injection, False, 0, replace

    def __call__(self, module, args, kwargs, out):
        inj = self.injection
        bound = _bound(module, args, kwargs)
        if self.inside or bound is None or not _unset(bound, inj.arg, inj.flag):
            return None  # the injected run itself, or the forward hands the argument on
        call = float_leaves((args, kwargs))
        bound.arguments[inj.arg] = inj.value(call)
        self.inside = True
        try:
            extra = module(*bound.args, **bound.kwargs)
        finally:
            self.inside = False
        joined = _joined(out, extra, self.replace)
        self.joined += joined is not None
        return joined


@contextlib.contextmanager
def injected(model, injections):
    """While inside, each of ``injections`` runs its holder of ``model`` again (see the module's
    docstring); yields the hooks."""
    hooks = [_Hook(i) for i in injections]
    with forward_hooks(model, [(h.injection.path, h) for h in hooks]):
        yield hooks


@contextlib.contextmanager
def substituted(model, injection: Injection):
    """While inside, the holder of ``injection`` returns its run on the injected argument in
    place of its own result (the floating tensors :func:`injected` adds ``0 *`` to): ``model``
    runs as if the forward handed the holder the argument, the function whose symmetry the
    program's extra run claims (:func:`symgraph.report.certify.certify` checks it). Yields the hook, whose
    ``joined`` counts the calls replaced."""
    hook = _Hook(injection, replace=True)
    handle = model.get_submodule(injection.path).register_forward_hook(hook, with_kwargs=True)
    try:
        yield hook
    finally:
        handle.remove()


@dataclass
class _Call:
    """A module's first call in the trial: its arguments as bound (None: they do not bind), its
    floating inputs, the shapes its floating inputs and outputs have, and its output's form
    (:func:`_form`)."""
    bound: inspect.BoundArguments | None
    floats: list
    shapes: list
    form: tuple


def _form(out) -> tuple:
    """``out``'s structure and, per leaf, its shape and dtype where it is a floating tensor."""
    leaves, spec = tree_flatten(out)
    return spec, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
                  for t in leaves]


def _joinable(form: tuple, extra) -> bool:
    """Whether :func:`_joined` of an output of ``form`` and ``extra`` adds anything."""
    spec, leaves = form
    other_spec, other = _form(extra)
    return spec == other_spec and any(c is not None for c in _matched(leaves, other))


def _calls(model, args, kwargs, holders: set) -> dict:
    """By name, the first call of each module in ``holders`` and of each of their children
    (:class:`_Call`; a child's arguments are not kept) in a trial run on the inputs."""
    calls: dict = {}

    def record(name):
        def hook(module, a, kw, out):
            if name not in calls:
                floats = float_leaves((a, kw))
                mine = name in holders
                calls[name] = _Call(_bound(module, a, kw) if mine else None, floats if mine else [],
                                    [tuple(t.shape) for t in floats + float_leaves(out)], _form(out))
        return hook
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in model.named_modules()
               if n in holders or n.rpartition(".")[0] in holders]
    try:
        parameter_reads(model, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _candidates(path: str, arg: str, calls: dict) -> list[Injection]:
    """The values tried for ``arg`` of the holder at ``path`` (see the module's docstring)."""
    own = calls[path]
    tried = [Injection(path, arg, index=i) for i in range(len(own.floats))]
    children = [c for n, c in calls.items() if n.rpartition(".")[0] == path]
    shapes = dict.fromkeys(s[:-1] for c in (*children, own) for s in c.shapes if len(s) >= 3)
    return tried + [Injection(path, arg, shape=s) for s in shapes]


def _above(model, unread: list[str]) -> list[str]:
    """The modules above the unread parameters (the model itself excluded) whose forward takes
    an optional tensor argument or a switch (:func:`_flags`), nearest first."""
    out: dict = {}
    for name in unread:
        parts = name.split(".")[:-1]
        for k in range(len(parts), 0, -1):
            path = ".".join(parts[:k])
            if path not in out:
                m = model.get_submodule(path)
                out[path] = bool(_optional_tensors(m) or _flags(m))
    return [p for p, takes in out.items() if takes]


def _tried(model, call: _Call, inj: Injection) -> frozenset | None:
    """The parameters (by the model's names) the holder reads, run alone on its recorded call
    with ``inj``'s argument set, where its result is finite and joins its output; else None."""
    module = model.get_submodule(inj.path)
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") \
        if isinstance(t, torch.Tensor) and t.is_meta else t  # noqa: E731 (a trial's fake tensor)
    assert call.bound is not None  # a holder's call is kept
    bound = inspect.BoundArguments(call.bound.signature, {k: tree_map(meta, v) for k, v in call.bound.arguments.items()})
    bound.arguments[inj.arg] = inj.value([meta(t) for t in call.floats])
    seen: list = []
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        reads = parameter_reads(module, bound.args, bound.kwargs)
    finally:
        handle.remove()
    if reads is None or not seen or not _joinable(call.form, seen[0]):
        return None
    if not all(t.is_meta or bool(torch.isfinite(t).all()) for t in float_leaves(seen[0])):
        return None  # 0 * inf is no zero
    return frozenset(f"{inj.path}.{n}" for n in reads)


def holder_injections(model, args, kwargs, unread: list[str] | None = None) -> list[Injection]:
    """The holders' optional arguments that make the holder, run on its call in the forward on
    ``args``/``kwargs``, read a parameter under it the forward leaves ``unread`` (found by a
    trial run where not given; see the module's docstring), in :data:`MAX_TRIALS` trial runs of
    a holder at most; none where every parameter is read or the forward refuses the inputs."""
    if unread is None:
        base = parameter_reads(model, args, kwargs)
        if base is None:
            return []
        unread = [n for n, _ in model.named_parameters() if n not in base]
    holders = _above(model, unread)
    calls = _calls(model, args, kwargs, set(holders)) if holders else {}
    kept, budget = [], MAX_TRIALS
    for path in holders:
        call = calls.get(path)
        if call is None or call.bound is None:  # not called, or called in a way that does not bind
            continue
        holder = model.get_submodule(path)
        args = [(a, False) for a in _optional_tensors(holder)] + [(a, True) for a in _flags(holder)]
        for arg, flag in [(a, f) for a, f in args if _unset(call.bound, a, f)]:
            mine = {n for n in unread if n.startswith(path + ".")}
            tried = [Injection(path, arg, flag=True)] if flag else _candidates(path, arg, calls)
            for inj in tried if mine and budget > 0 else ():
                budget -= 1
                reads = _tried(model, call, inj)
                if reads is not None and reads & mine:
                    kept.append(inj)
                    unread = [n for n in unread if n not in reads]
                    break
    return kept


def traced_with_holders(model, traced, exported, export, stack: contextlib.ExitStack):
    """``exported`` (``(program, branches taken)``, exported from ``model`` on ``traced``,
    ``(args, kwargs)``) where it reads every parameter; else ``export()`` run again with the
    holders' injections (:func:`holder_injections`) and, for the parameters no holder reads,
    the methods that read them (:func:`.entry_points.entry_points`), or, where none is found,
    the modules that read them in training mode (:func:`.training_runs.training_runs`) entered
    into ``stack`` (they stay while it is open: a twin traced for its constants runs them too), or ``exported`` where
    none is found or that export fails. Returns the program, whether branches were taken, and
    what was found (injections, entry points, then training runs)."""
    unread = unread_parameters(exported[0])
    found = holder_injections(model, traced[0], traced[1], unread) if unread else []
    left = [n for n in unread if not any(n.startswith(i.path + ".") for i in found)]
    entries = entry_points(model, traced[0], traced[1], left) if left else []
    # methods are kept only where, with deadcode, they read every parameter left: none to train
    runs = training_runs(model, traced[0], traced[1], left) if left and not entries else []
    if not found and not entries and not runs:
        return (*exported, [])
    inner = contextlib.ExitStack()
    inner.enter_context(injected(model, found))
    inner.enter_context(entered(model, entries))
    inner.enter_context(trained(model, runs))
    try:
        ep, branched = export()
    except Exception:  # noqa: BLE001 - the plain program stands, its parameters unread
        inner.close()
        return (*exported, [])
    stack.enter_context(inner)
    return ep, branched, [*found, *entries, *runs]

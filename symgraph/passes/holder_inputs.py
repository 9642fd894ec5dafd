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
(default ``None``, annotated as a tensor) left unset. The values tried, in order: each floating
tensor the holder is called with (a fusion layer's residual is a tensor of its input's shape),
then a boolean mask, every third entry set (as :func:`.optional_inputs.masked_patches`), of the
shape of each tensor the holder or one of its children takes or returns, less its last axis.
One is kept where the holder, run on it, reads a parameter under it that was unread before.

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
from torch.utils._pytree import tree_flatten, tree_unflatten

from .nodes import unread_parameters
from .optional_inputs import parameter_reads

__all__ = ["HOLDERS", "Injection", "holder_injections", "injected", "traced_with_holders", "MAX_TRIALS"]

MAX_TRIALS = 24  # trial runs at most per trace (each one runs the whole forward)
HOLDERS = "symgraph_holders"  # graph meta: the injections the program was traced under


@dataclass(frozen=True)
class Injection:
    """The holder at ``path`` run again with ``arg`` set: the ``index``-th floating tensor it is
    called with (``shape`` None), else a boolean mask of ``shape``."""
    path: str
    arg: str
    index: int | None = None
    shape: tuple | None = None

    def value(self, call: list):
        """The argument for a call whose floating tensors are ``call``."""
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


def _floats(args, kwargs) -> list:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _bound(module, args, kwargs):
    """``args``/``kwargs`` bound to ``module.forward``'s signature, or None where they do not bind."""
    try:
        return inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None


def _joined(out, extra):
    """``out`` with ``0 * x`` added to each floating tensor from ``extra`` of its shape (the
    same structure), or None where they share none."""
    a, spec = tree_flatten(out)
    b, spec_b = tree_flatten(extra)
    if spec != spec_b:
        return None
    same = [isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point()
            and x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b)]
    if not any(same):
        return None
    return tree_unflatten([x + 0 * y if s else x for x, y, s in zip(a, b, same)], spec)


class _Hook:
    """The forward hook running a holder again on its injected argument (see the module's
    docstring); ``joined`` counts the runs whose result reached the holder's output. In a trial
    (``checked``) on real values, a result not finite is not joined (``0 * inf`` is no zero) and
    counted in ``infinite``."""

    def __init__(self, injection: Injection, checked: bool = False):
        self.injection, self.inside, self.joined, self.checked, self.infinite = injection, False, 0, checked, 0

    def __call__(self, module, args, kwargs, out):
        inj = self.injection
        bound = _bound(module, args, kwargs)
        if self.inside or bound is None or bound.arguments.get(inj.arg) is not None:
            return None  # the injected run itself, or the forward hands the argument on
        call = _floats(args, kwargs)
        bound.arguments[inj.arg] = inj.value(call)
        self.inside = True
        try:
            extra = module(*bound.args, **bound.kwargs)
        finally:
            self.inside = False
        if self.checked and not all(t.is_meta or bool(torch.isfinite(t).all()) for t in _floats(extra, {})):
            self.infinite += 1
            return None
        joined = _joined(out, extra)
        self.joined += joined is not None
        return joined


@contextlib.contextmanager
def injected(model, injections, checked: bool = False):
    """While inside, each of ``injections`` runs its holder of ``model`` again (see the module's
    docstring); yields the hooks (``checked``: see :class:`_Hook`)."""
    hooks = [_Hook(i, checked) for i in injections]
    handles = [model.get_submodule(h.injection.path).register_forward_hook(h, with_kwargs=True) for h in hooks]
    try:
        yield hooks
    finally:
        for h in handles:
            h.remove()


@dataclass
class _Call:
    """A module's first call in the trial: its arguments as bound, its floating inputs, and the
    shapes its floating inputs and outputs have."""
    bound: object
    floats: int
    shapes: list


def _calls(model, args, kwargs):
    """The parameters the forward reads on the inputs (None where it refuses them) and, by
    name, every module's first call (:class:`_Call`; the model's own excluded)."""
    calls: dict = {}

    def record(name):
        def hook(module, a, kw, out):
            if name not in calls:
                floats = _floats(a, kw)
                calls[name] = _Call(_bound(module, a, kw), len(floats),
                                    [tuple(t.shape) for t in floats + _floats(out, {})])
        return hook
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in model.named_modules() if n]
    try:
        return parameter_reads(model, args, kwargs), calls
    finally:
        for h in handles:
            h.remove()


def _candidates(path: str, arg: str, calls: dict) -> list[Injection]:
    """The values tried for ``arg`` of the holder at ``path`` (see the module's docstring)."""
    own = calls[path]
    tried = [Injection(path, arg, index=i) for i in range(own.floats)]
    children = [c for n, c in calls.items() if n.startswith(path + ".") and "." not in n[len(path) + 1:]]
    shapes = dict.fromkeys(s[:-1] for c in (*children, own) for s in c.shapes if len(s) >= 3)
    return tried + [Injection(path, arg, shape=s) for s in shapes]


def _holders(model, unread: list[str], calls: dict) -> list[tuple[str, str]]:
    """``(module, argument)`` pairs to try, in order: for each unread parameter, each module
    above it that the forward called with an optional tensor argument unset, nearest first."""
    pairs: dict = {}
    for name in unread:
        parts = name.split(".")[:-1]
        for k in range(len(parts), 0, -1):
            path = ".".join(parts[:k])
            call = calls.get(path)
            if call is None or call.bound is None:
                continue
            for arg in _optional_tensors(model.get_submodule(path)):
                if call.bound.arguments.get(arg) is None:
                    pairs.setdefault((path, arg), None)
    return list(pairs)


def holder_injections(model, args, kwargs) -> list[Injection]:
    """The holders' optional arguments that make the forward on ``args``/``kwargs`` read a
    parameter under the holder it reads on none of them alone (see the module's docstring),
    found in :data:`MAX_TRIALS` trial runs at most; none where every parameter is read or the
    forward refuses the inputs."""
    base, calls = _calls(model, args, kwargs)
    if base is None:
        return []
    unread = [n for n, _ in model.named_parameters() if n not in base]
    kept, budget = [], MAX_TRIALS
    for path, arg in _holders(model, unread, calls):
        mine = {n for n in unread if n.startswith(path + ".")}
        for inj in _candidates(path, arg, calls) if mine and budget > 0 else ():
            budget -= 1
            with injected(model, [inj], checked=True) as (hook,):
                reads = parameter_reads(model, args, kwargs)
            if reads is not None and hook.joined and not hook.infinite and reads & mine:
                kept.append(inj)
                unread = [n for n in unread if n not in reads]
                break
    return kept


def traced_with_holders(model, traced, exported, export, stack: contextlib.ExitStack):
    """``exported`` (``(program, branches taken)``, exported from ``model`` on ``traced``,
    ``(args, kwargs)``) where it reads every parameter; else ``export()`` run again with the
    holders' injections (:func:`holder_injections`) entered into ``stack`` (they stay while it is
    open: a twin traced for its constants runs them too), or ``exported`` where none is found or
    that export fails. Returns the program, whether branches were taken, and the injections."""
    found = holder_injections(model, *traced) if unread_parameters(exported[0]) else []
    if not found:
        return (*exported, [])
    inner = contextlib.ExitStack()
    inner.enter_context(injected(model, found))
    try:
        ep, branched = export()
    except Exception:  # noqa: BLE001 - the plain program stands, its parameters unread
        inner.close()
        return (*exported, [])
    stack.enter_context(inner)
    return ep, branched, found

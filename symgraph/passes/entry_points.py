"""Other entry points (issue 65): a parameter the forward never reads that another method of the
model reads (ESM's contact head: ``predict_contacts(tokens, attention_mask)`` runs the model
for its attention maps and regresses contacts from them). A parameter the traced program never
reads fixes every class, so the trace also runs the method, in the same program, under the
model's own parameter names.

The method is found by trial runs that observe the parameters read
(:func:`.optional_inputs.parameter_reads`), never by its name: for an unread parameter, each
module above it (nearest first, the model last) whose class, in the model's own source file
(its module's, not a library base's), defines a public method other than ``forward`` with a
required argument. Its required arguments: one the forward was given by the same name takes
that; else one named as a field of a module's output in the forward's run (a model output's
``asr_last_hidden_state``, which Nemotron 3.5 Transcribe's ``get_word_timestamp_logits``
takes) the first such field's value, the forward's own (in the program, its traced value: the
method reads what the parameters computed, so their axes meet); else the first takes the main
input (the forward's first tensor), any other an all-ones tensor of the main input's shape (a
mask that keeps every position). Run as it is, and, where that
fails and the model can switch (``set_attn_implementation``), under eager attention (a method
that reads attention maps gets none from SDPA). Kept where it reads an unread parameter.

Tried first: the forward of a sub-model the forward reads nothing of (a module with a config
and a main input of its own: Kyutai's codec, a Mimi that turns audio into codes only in
``generate``), outermost first, on its own example inputs (:func:`.inputs.default_inputs` of
it, from its config), made in the program from their shapes alone (:func:`own_value`); its
trial runs on the model itself (its buffers may hold the sizes it computes with). Kept only
where its results include codes (integers): its boundary is then fixed in ``generate`` as in
the program, so its claims hold there too. One whose results are all floating (a tower, a
depth decoder) may hand ``generate`` states the model's own moving axes read, or read them:
fixing its boundary on its own inputs could claim that the two move apart, so it is not kept
(its parameters stay unread, and they fix every class). Assumed: a sub-model that makes codes
tokenizes data the user gives (audio, images), not the model's own states.

In the program the method runs after the forward on the same inputs, and ``0 * s`` is added to
the forward's first floating output, ``s`` the sum of the method's tensor results (integer
ones, codes, as floats: a method whose only result is codes is kept too) each times a constant
that varies along every axis: the program computes the plain forward (exactly: where the
result is not finite, ``s`` counts as zero), its consumers see the model's values on a user's batch, and the
analysis keeps every axis of the method's result fixed (a constant's axes are), as if it were an
output: each claim holds of the method too.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.devices import weightless_twin
from .closed_reads import proven_dead
from .optional_inputs import modules_above, parameter_reads

__all__ = ["FIELD", "EntryPoint", "entry_points", "entered", "entry_results", "own_methods", "recorded",
           "varying_sum"]


@dataclass(frozen=True)
class EntryPoint:
    """The method ``method`` of the module at ``path`` (``""``: the model), its required
    arguments filled as ``fill`` says (``"main"``, ``"ones"``, the name of a forward input,
    ``"field:NAME"``: the field ``NAME`` of a module's output in the forward's run, or
    ``"own:NAME"``: a sub-model's own example input ``NAME``, of the shape and kind ``own``
    records as ``(NAME, shape, floating)``), run under eager attention where ``eager``."""
    path: str
    method: str
    fill: tuple
    eager: bool = False
    own: tuple = ()


def _main(args, kwargs):
    return next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)


def own_methods(module) -> list[tuple[str, list[str]]]:
    """``(name, required arguments)`` of the public methods other than ``forward`` that the
    classes of ``module`` define in its own source file (none for torch's own: a list's
    ``append``), with a required argument."""
    home, out = type(module).__module__, {}
    if home.split(".")[0] == "torch":
        return []
    for cls in type(module).__mro__:
        if cls.__module__ != home:
            continue
        for name, f in vars(cls).items():
            if name.startswith("_") or name == "forward" or name in out or not inspect.isfunction(f):
                continue
            params = list(inspect.signature(f).parameters.values())[1:]
            required = [p.name for p in params if p.default is inspect.Parameter.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if required and all(p.kind not in (p.VAR_POSITIONAL,) for p in params):
                out[name] = required
    return list(out.items())


FIELD = "field:"  # a fill naming a field of a module's output in the forward's run


def _fields_of(out, names, into: dict) -> None:
    """Into ``into``, each of ``names`` that ``out`` (a model output, a dict) holds as a tensor,
    unless ``into`` has it already (the first module's output that holds it wins)."""
    if hasattr(out, "keys"):
        for k in names:
            if k not in into and k in out.keys() and isinstance(out[k], torch.Tensor):
                into[k] = out[k]


@contextlib.contextmanager
def recorded(model, names):
    """While inside, the dict it yields takes, for each of ``names`` (all where None), the first
    tensor of that name among the fields of the outputs of ``model``'s modules."""
    got: dict = {}
    if names is not None and not names:
        yield got
        return

    def hook(module, args, out):
        keys = out.keys() if names is None and hasattr(out, "keys") else names
        _fields_of(out, keys, got)
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _fields(entry: EntryPoint) -> list[str]:
    return [f[len(FIELD):] for f in entry.fill if f.startswith(FIELD)]


OWN = "own:"  # a fill naming a sub-model's own example input


def own_value(shape, floating: bool, module, device):
    """A sub-model's own example input of ``shape``, made in the program from nothing but its
    shape (the same on every run, so the certificate sees what the trace saw): floats, in the
    dtype of ``module``'s parameters, a wave along the flattened entries that takes a new value
    at each (a sample of a tone, for audio); integers, zeros (the first id, a valid one)."""
    n = math.prod(shape)
    if not floating:
        return torch.zeros(shape, dtype=torch.long, device=device)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    t = torch.linspace(0.0, 0.37 * max(n - 1, 0), n, dtype=dtype, device=device)
    return (0.1 * torch.sin(t)).reshape(shape)


def _arguments(entry: EntryPoint, args, kwargs, fields: dict, module) -> list | None:
    main = _main(args, kwargs)
    if main is None or any(n not in fields for n in _fields(entry)):
        return None
    own = {name: own_value(shape, floating, module, main.device) for name, shape, floating in entry.own}
    return [main if f == "main" else torch.ones_like(main) if f == "ones" else
            fields[f[len(FIELD):]] if f.startswith(FIELD) else own[f[len(OWN):]] if f.startswith(OWN)
            else kwargs[f] for f in entry.fill]


@contextlib.contextmanager
def _attention(model, eager: bool):
    """Eager attention while inside where ``eager``; every config's attention implementation
    put back as it was after (set directly: a tower that refuses SDPA would refuse it set back)."""
    if not eager:
        yield
        return
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for c in list(configs.values()):  # sub-configs no module of its own holds
        for v in vars(c).values() if hasattr(c, "__dict__") else ():
            if hasattr(v, "__dict__") and "_attn_implementation_internal" in vars(v):
                configs.setdefault(id(v), v)
    saved = {k: vars(c)["_attn_implementation_internal"] for k, c in configs.items()
             if "_attn_implementation_internal" in vars(c)}
    try:
        model.set_attn_implementation("eager")
        yield
    finally:
        for k, v in saved.items():
            configs[k]._attn_implementation_internal = v


def _run(model, entry: EntryPoint, args, kwargs, fields: dict | None = None):
    """``entry``'s method run on the inputs; the fields it takes from the forward's run are
    ``fields``, or, where not given, taken from a run of the forward on the inputs first."""
    method = getattr(model.get_submodule(entry.path), entry.method)
    if fields is None:
        with recorded(model, _fields(entry)) as fields:
            if _fields(entry):
                model(*args, **kwargs)
    margs = _arguments(entry, args, kwargs, fields, model.get_submodule(entry.path))
    if margs is None:
        raise ValueError("no tensor input to give the method")  # a trial refused, as a failed run
    with _attention(model, entry.eager):
        if entry.own:  # a sub-model's forward: its own inputs by name
            return method(**{f[len(OWN):]: v for f, v in zip(entry.fill, margs)})
        return method(*margs)


def _results(out) -> list:
    """The tensors of ``out``: the floating ones, and the others (codes, masks) as floats."""
    return [t if t.is_floating_point() else t.float()
            for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and not t.is_complex()]


def entry_results(model, entry: EntryPoint, args, kwargs, fields: dict | None = None) -> list:
    """The tensors ``entry``'s method returns (:func:`_results`), run on ``model`` with the
    forward's inputs ``args``/``kwargs`` (and the fields of ``fields``, else of a run of the
    forward on them) as the program runs it (:func:`symgraph.report.certify.certify` compares them)."""
    return _results(_run(model, entry, args, kwargs, fields))


def _codes(out) -> bool:
    """Whether ``out`` holds an integer tensor (codes)."""
    return any(isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
               for t in tree_flatten(out)[0])


def _tried(model, entry: EntryPoint, args, kwargs, fields: dict) -> frozenset | None:
    """The parameters the method reads on the inputs (the forward's output ``fields`` where it
    takes one), where its result is finite and, for a sub-model's forward, holds codes (see
    the module's docstring); else None."""
    seen: list = []
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    reads = parameter_reads(model, (), {}, run=lambda: seen.append(_run(model, entry, args, kwargs, fields)))
    if reads is None or not seen or not _results(seen[0]) or (entry.own and not _codes(seen[0])):
        return None
    if not all(t.is_meta or bool(torch.isfinite(t).all()) for t in _results(seen[0])):
        return None
    return reads


class _Fields:
    """The tensor fields of the outputs of ``model``'s modules in one trial run of its forward
    on ``args``/``kwargs``, on a twin on ``meta`` (their shapes, as meta tensors; none where it
    refuses them), made where first asked."""

    def __init__(self, model, args, kwargs):
        self.model, self.inputs, self._got = model, (args, kwargs), None

    def get(self) -> dict:
        if self._got is None:
            twin = weightless_twin(self.model)
            dev = next((p.device for p in twin.parameters()), torch.device("cpu"))
            args, kwargs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, self.inputs)
            with recorded(twin, None) as got:
                parameter_reads(twin, args, kwargs)
            self._got = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in got.items()}
        return self._got


def _fill(required: list[str], kwargs, fields: _Fields) -> tuple:
    """How ``required`` arguments are filled (see the module's docstring); the forward's output
    ``fields`` are asked only where an argument is no forward input."""
    out = []
    for i, a in enumerate(required):
        if a in kwargs:
            out.append(a)
        elif a in fields.get():
            out.append(FIELD + a)
        else:
            out.append("main" if i == 0 else "ones")
    return tuple(out)


def _entries(model, unread: list[str], kwargs, fields: _Fields):
    """The candidates, in order (see the module's docstring), made as they are asked for."""
    for path in modules_above(unread):
        for name, required in own_methods(model.get_submodule(path)):
            fill = _fill(required, kwargs, fields)
            yield from [EntryPoint(path, name, fill, eager) for eager in (False, True)
                        if not eager or hasattr(model, "set_attn_implementation")]


def _required(f) -> list[str]:
    return [p.name for p in list(inspect.signature(f).parameters.values())
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _sub_models(model, unread: list[str]):
    """The forwards of the sub-models (modules with a config and a main input of their own, a
    speech model's codec) the forward never reads, outermost first (one run reads the most),
    each given its main input and its other required arguments from its own example inputs
    (:func:`.inputs.default_inputs`, from its config), where they give them all; made as they
    are asked for (each costs its own trial runs)."""
    from .inputs import default_inputs  # example inputs import these passes
    left = set(unread)
    for path in reversed(modules_above(unread)):
        sub = model.get_submodule(path)
        if not path or getattr(sub, "config", None) is None or not hasattr(sub, "main_input_name"):
            continue
        if any(f"{path}.{n}" not in left for n, _ in sub.named_parameters()):
            continue  # the forward reads it: a lever of its call, not a run of its own
        try:
            own_args, own_kwargs = default_inputs(sub)
        except Exception:  # noqa: BLE001 - no example inputs from its config
            continue
        takes = inspect.signature(sub.forward).parameters
        required = [a for a in takes if a in _required(sub.forward) or a == sub.main_input_name]
        if own_args or any(not isinstance(own_kwargs.get(a), torch.Tensor) for a in required):
            continue
        own = tuple((a, tuple(own_kwargs[a].shape), own_kwargs[a].is_floating_point()) for a in required)
        yield EntryPoint(path, "forward", tuple(OWN + a for a in required), own=own)


def _needed(kept: list, unread: set) -> list[EntryPoint]:
    """The kept entries (``(entry, reads)``) but each whose unread reads the others cover (a
    method that another kept one calls: Nemotron 3.5 Transcribe's word-timestamp states, which
    its logits method computes), tried in order."""
    out = list(kept)
    for e in kept:
        rest = [r for x, r in out if x is not e[0]]
        if (e[1] & unread) <= frozenset().union(*rest):
            out = [x for x in out if x[0] is not e[0]]
    return [e for e, _ in out]


def entry_points(model, args, kwargs, unread: list[str], budget: int = 8) -> list[EntryPoint]:
    """The methods that read a parameter the forward on ``args``/``kwargs`` leaves ``unread``
    (see the module's docstring), in ``budget`` trial runs at most, each on a new twin of the
    model on ``meta`` (:func:`~symgraph.core.devices.weightless_twin`: a method that
    changes the module it is called on, a setter, changes that twin only); none whose reads the
    others cover (:func:`_needed`), and none at all where a parameter neither they read nor
    a proof shows dead (:func:`.closed_reads.proven_dead`, as the trace takes it) is left (it
    fixes every class whatever they read: their trace would only cost time; Nemotron 3.5
    Transcribe's diarization ``silence_embeds``)."""
    kept: list = []
    left, fields = set(unread), _Fields(model, args, kwargs)
    for entry in itertools.chain(_sub_models(model, unread), _entries(model, unread, kwargs, fields)):
        if not left or budget <= 0:
            break
        if any(e.path == entry.path and e.method == entry.method for e, _ in kept):
            continue
        budget -= 1
        # a twin each: one trial's changes stay its own; a sub-model's forward, no setter, on
        # the model (its buffers may hold the sizes it computes with: Mimi's paddings)
        twin = model if entry.own else weightless_twin(model)
        reads = _tried(twin, entry, args, kwargs, fields.get() if _fields(entry) else {})
        if reads is not None and reads & left:
            kept.append((entry, reads))
            left -= reads
    if left and set(proven_dead(model, sorted(left))) != left:
        return []  # a parameter still unread fixes every class: the methods' trace would buy nothing
    return _needed(kept, set(unread))


def _joined(out, extra):
    """``out`` with ``0 * s`` added to its first floating tensor (see the module's docstring)."""
    leaves, spec = tree_flatten(out)
    first = next((i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if first is None:
        return None
    leaves[first] = leaves[first] + 0 * varying_sum(extra)
    return tree_unflatten(leaves, spec)


def varying_sum(extra):
    """The sum of the tensors ``extra``, each times a constant that varies along every axis
    (so that no axis of theirs can move unseen): what an extra run adds as ``0 *``. Zero where
    the sum is not finite (a user's batch the extra run overflows on), so ``0 *`` it stays zero
    and the forward's outputs stay exact."""
    s = sum((r * torch.linspace(1.0, 2.0, r.numel(), dtype=r.dtype, device=r.device).reshape(r.shape)).sum()
            for r in extra)
    return torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0) if isinstance(s, torch.Tensor) else s


@contextlib.contextmanager
def entered(model, entries):
    """While inside, the model's forward also runs each of ``entries`` (see the module's
    docstring)."""
    inside: list = []
    names = sorted({n for e in entries for n in _fields(e)})

    def start(module, args):
        if not inside:
            got.clear()  # this run's fields only

    def hook(module, args, kwargs, out):
        if inside or not entries:
            return None
        inside.append(True)
        try:
            # the hooked model: a twin traced for its constants runs its own methods
            extra = [t for e in entries for t in entry_results(module, e, args, kwargs, dict(got))]
        finally:
            inside.clear()
        return _joined(out, extra)

    with recorded(model, names) as got:
        handles = [model.register_forward_pre_hook(start), model.register_forward_hook(hook, with_kwargs=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

"""Tracing: ``torch.export`` into an ATen graph whose ops all have rules or are core ATen."""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..core.devices import weightless_twin
from ..core.dtypes import parameters_dtype
from ..core.modes import set_mode
from ..core.finite import check_keywords, check_token_batch, require_module
from ..errors import InputError, TraceError, UnsizedOnMeta
from .concrete import concretize, has_data_dependent_sizes
from .experts import batched_experts
from .export_inputs import precomputed_inputs
from .holder_inputs import HOLDERS, traced_with_holders
from .index_lists import stacked_index_lists
from .output_caches import caches_dropped
from .inputs import default_inputs, is_hf
from .closed_reads import proven_dead
from .deadcode import DEAD
from .nodes import BRANCHES_TAKEN, HIDDEN_OUTPUTS, UNREAD, packet, unread_parameters
from .real_values import export_real_values, real_values
from .registry import has_rule

__all__ = ['model_device', 'varying_nodes', 'default_inputs', 'split_inputs', 'eval_mode', 'trace', 'flatten_outputs',
           'output_deviation', 'head_outputs', 'HIDDEN_OUTPUTS']

aten = torch.ops.aten


_is_hf = is_hf


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def split_inputs(model, inputs):
    """Normalise the user's ``inputs`` into ``(args, kwargs)``."""
    if inputs is None:
        return default_inputs(model)
    extra = {}
    if _is_hf(model) and "use_cache" in inspect.signature(model.forward).parameters:
        extra["use_cache"] = False
    if isinstance(inputs, dict):
        return (), {**extra, **inputs}
    if isinstance(inputs, torch.Tensor):
        return (inputs,), extra
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), extra
    raise InputError(
        f"inputs must be a tuple of positional example inputs or a dict of keyword inputs, "
        f"got {type(inputs).__name__}")


@contextlib.contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode and restore every module's flag afterwards. Entered and left
    through ``train()``, by which a module drops what it caches from its parameters while in
    eval (LeViT's gathered attention biases): the program run or traced reads the parameters
    as they are now, and no traced value stays cached (:func:`~symgraph.core.modes.set_mode`:
    torch's ``train``, not a transformers model's, which re-kernelizes)."""
    flags = [(m, m.training) for m in model.modules()]
    set_mode(model, True)
    set_mode(model, False)
    try:
        yield model
    finally:
        set_mode(model, True)
        for m, f in flags:
            m.training = f


@contextlib.contextmanager
def graph_friendly(model):
    """Hugging Face mixture-of-experts blocks run under an *experts implementation*
    (``config._experts_implementation``): trace and certify with ``batched_mm``
    (:mod:`.experts`: ``grouped_mm`` sorts tokens by expert, which no rule follows), and with
    every config's ``use_cache`` off (a model whose forward takes no ``use_cache`` but reads its
    config's, as a vision- or audio-language model's inner decoder does, would otherwise return
    a ``DynamicCache``, which no exported program can hold); every config is restored afterwards.
    A contraction of two floating dtypes runs in the parameters' dtype
    (:func:`symgraph.core.dtypes.parameters_dtype`)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for c in list(configs.values()):  # sub-configs no module of their own holds (text, audio)
        for v in vars(c).values() if hasattr(c, "__dict__") else ():
            if hasattr(v, "__dict__") and "use_cache" in vars(v):
                configs.setdefault(id(v), v)
    caches = {k: True for k, c in configs.items() if hasattr(c, "__dict__") and vars(c).get("use_cache") is True}
    try:
        with batched_experts(model), parameters_dtype(model):
            for k in caches:
                configs[k].use_cache = False
            yield model
    finally:
        for k, v in caches.items():
            configs[k].use_cache = v


@contextlib.contextmanager
def conversions_in_place():
    """A forward that converts a submodule to the dtype and device it already has (a router kept
    in float32: ``self.classifier.to(self.dtype)``) changes nothing, but under ``torch.export``
    its parameters are functional tensors that ``Module.to`` tries, and fails, to swap: while
    tracing, such a conversion returns the module as it is; any other runs as usual."""
    orig = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
        same = all((device is None or t.device == device)
                   and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                   for t in (*self.parameters(), *self.buffers()))
        return self if same and fmt is None else orig(self, *args, **kwargs)
    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = orig


@contextlib.contextmanager
def copies_in_program():
    """A deep copy of a value the program computes (``generate`` copies its generation config,
    which holds the pad token as a tensor) cannot read that value's storage, which a traced
    value has none of: while tracing, it is the value cloned in the program (``deepcopy``'s
    memo keeps shared references shared)."""
    copy_of = torch.Tensor.__deepcopy__

    def deepcopy(self, memo):
        return self.clone() if isinstance(self, (FakeTensor, FunctionalTensor)) else copy_of(self, memo)
    torch.Tensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__ = copy_of


def varying_nodes(ep):
    """Nodes whose values depend on a parameter or a user input. The analysis never applies a
    rule to the others (constants: positions, masks), so they need no decomposition."""
    from .driver import CONST_OPS
    sig = ep.graph_signature
    sources = set(sig.inputs_to_parameters) | set(sig.user_inputs)
    varying = set()
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in sources:
                varying.add(n)
        elif n.op == "call_function":
            if packet(n) not in CONST_OPS and any(i in varying for i in n.all_input_nodes):
                varying.add(n)
    return varying


def _mutates(ep) -> bool:
    """Whether the exported graph writes into a tensor in place (``x[:, t] = y`` in a model's
    loop is ``copy_`` into a view of ``x``): the rules read values as functions of their
    arguments, so such a graph is functionalised first (``run_decompositions`` turns the write
    into ``select_scatter``/``slice_scatter``, whose rules see both the base and what is written)."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable for n in ep.graph.nodes)


def _unruled_decomposable(ep):
    """Decompositions for the unruled ops on parameter/input-dependent values, and whether a
    re-trace is needed anyway (composite ops, wrapped subgraphs: ``run_decompositions``
    inlines them; in-place writes: it functionalises them)."""
    from .driver import IGNORED
    unruled, retrace = set(), _mutates(ep)
    for n in varying_nodes(ep):
        t = n.target
        if n.op != "call_function":
            continue
        if isinstance(t, torch._ops.HigherOrderOperator):
            retrace = True
        elif isinstance(t, torch._ops.OpOverload) and not has_rule(t) \
                and t.overloadpacket not in IGNORED:
            unruled.add(t)
    if not unruled:  # the usual case: building the table alone costs ~60 ms
        return {}, retrace
    from torch._decomp import core_aten_decompositions
    table = core_aten_decompositions()
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    retrace = retrace or any(t not in table and t.has_kernel_for_dispatch_key(cia) for t in unruled)
    return {t: table[t] for t in unruled if t in table}, retrace


def _hint(model, args, kwargs) -> str:
    """What to try, for the kind of model that failed."""
    shapes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    shapes |= {f"arg{i}": tuple(v.shape) for i, v in enumerate(args) if isinstance(v, torch.Tensor)}
    cfg = getattr(model, "config", None)
    if "pixel_values" in shapes:
        return (f"the model was run on pixel_values of shape {shapes['pixel_values']}; check that it "
                "matches the config (num_channels, image_size) or pass inputs= of the right shape.")
    if getattr(cfg, "is_encoder_decoder", False):
        return ("encoder-decoder models need decoder_input_ids as well as input_ids; pass inputs="
                "{'input_ids': ..., 'decoder_input_ids': ...}.")
    if "use_cache" in inspect.signature(model.forward).parameters:
        return ("the model must run on the example inputs with static control flow; Hugging Face "
                "decoders are traced with use_cache=False.")
    return ("the model must run on the given example inputs (shapes " + str(shapes) + ") with static "
            "control flow (no data-dependent branches).")


def _constants_from_fake_twin(ep, model, args, kwargs):
    """Give ``ep`` (a model on ``meta`` traced) the values of the tensor constants its forward
    created on the model's device (index lists such as ``x[..., [-2], :]``: on ``meta`` they
    hold none, and the rules that read them cannot): the same forward is traced again on a
    twin whose weights are fake CPU tensors (no memory), on the inputs put on the CPU (a meta
    one as zeros of its shape: the trace reads no value), where the constants come out real,
    and each constant the two traces share by name, shape and dtype is taken from it. A twin
    that cannot be built or traced changes nothing: the meta trace stands, its constants
    unknown (tracing the twin on the meta inputs as they are fails on torch 2.11, whose fake
    tensors refuse an op mixing the CPU weights with meta inputs)."""
    lost = {k for k, v in ep.constants.items() if isinstance(v, torch.Tensor) and v.is_meta}
    owned = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    lost -= owned
    if not lost:
        return
    try:
        other = _fake_twin_trace(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the meta trace stands; its constants stay unknown
        return
    from torch._subclasses.fake_tensor import FakeTensor
    for k in lost:
        v, w = ep.constants[k], other.constants.get(k)
        if isinstance(w, torch.Tensor) and not isinstance(w, FakeTensor) and w.shape == v.shape and w.dtype == v.dtype:
            ep.constants[k] = w


def _fake_twin_trace(model, args, kwargs):
    """``model``'s forward exported on its twin with fake CPU weights
    (:func:`~symgraph.core.devices.weightless_twin`), on ``args``/``kwargs`` put on the CPU."""
    twin = weightless_twin(model, "cpu")
    cpu = lambda v: (torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v.to("cpu")) \
        if isinstance(v, torch.Tensor) else v  # noqa: E731
    with eval_mode(twin), graph_friendly(twin):
        return torch.export.export(twin, tuple(cpu(a) for a in args), {k: cpu(v) for k, v in kwargs.items()},
                                   strict=False)


def _data_dependent(e) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a guard on a value the data decides
    (``if mask.any().item():``, a loop over ``nonzero()``'s rows)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, GuardOnDataDependentSymNode):
            return True
        e = e.__cause__ or e.__context__
    return False


def _export(model, traced, on_meta: bool):
    """:func:`_export_once`; again without the caches of the output where it holds one
    (:mod:`.output_caches`; the certificate compares none either: :func:`flatten_outputs`)."""
    try:
        return _export_once(model, traced, on_meta)
    except Exception as e:  # noqa: BLE001 - re-raised unless a cache in the output is why
        if "Cache'> in output" not in str(e):
            raise
    with caches_dropped(model):
        return _export_once(model, traced, on_meta)


def _export_once(model, traced, on_meta: bool):
    """``torch.export`` of ``model`` on ``traced``. A forward that branches on a value of its
    data (LED's global attention ``if is_index_global_attn.any().item()``, a mixture's loop over
    the experts its router picked) cannot be traced symbolically; with weights at hand it is
    traced again with those values taken from a real run on the example inputs
    (``fake_tensor_propagate_real_tensors``, what ``torch.export.draft_export`` does, without its
    log files): each branch is the one the example takes, asserted in the graph. The analysis
    keeps every value the program reads as a number unchanged (:func:`.nodes.live_nodes`), so a
    symmetry it finds never changes a branch taken; where a branch not taken reads parameters,
    the analysis fixes every parameter (:meth:`.driver.AxisAnalysis.run`: what that branch does
    with them was never seen). On ``meta`` there is no value to take. Returns the program and
    whether branches were taken."""
    import io
    import sys
    dump = io.StringIO()  # torch prints the partial graph of a failed export to stderr
    try:
        with contextlib.redirect_stderr(dump):
            return torch.export.export(model, *traced, strict=False), False
    except Exception as e:  # noqa: BLE001 - re-raised unless precomputed inputs or real values help
        if on_meta:
            sys.stderr.write(dump.getvalue())
            raise
        first = e
    with precomputed_inputs(model, traced[0], traced[1], flatten_outputs) as handed:
        try:
            if handed:
                with contextlib.redirect_stderr(io.StringIO()):
                    return torch.export.export(model, *traced, strict=False), False
        except Exception as e:  # noqa: BLE001 - the first failure is what the user hears about
            first = e if _data_dependent(e) and not _data_dependent(first) else first
        if not _data_dependent(first):
            sys.stderr.write(dump.getvalue())
            raise first
        return export_real_values(model, traced, first), True


def trace(model, inputs=None, decompose: bool = True):
    """Export ``model`` (unchanged; eval mode inside) to an ATen-level ExportedProgram.

    Ops without a rule that core ATen can decompose are decomposed; the rest stay and the
    analysis fixes the axes they touch. ``decompose=False``: the ops as exported (a graph that
    is only run, never analysed: learned matching's loss).
    """
    require_module(model, "the model")
    args, kwargs = split_inputs(model, inputs)
    if inputs is not None:  # the user's, checked before the export runs them
        first = next(iter(inspect.signature(model.forward).parameters), None) if _is_hf(model) and args else None
        check_token_batch({"input_ids": args[0]} if first == "input_ids" else kwargs, "the inputs", model)
        check_keywords(model, kwargs, "the inputs")
    on_meta = next((p.is_meta for p in model.parameters()), False)
    given = args, kwargs
    traced = given
    if on_meta:  # a model without weights: floating inputs by shape only (returned so), and every
        # input traced on meta: torch 2.11 refuses an op mixing meta weights with CPU token ids
        to_meta = lambda v, floats=True: v.to("meta") if isinstance(v, torch.Tensor) and (  # noqa: E731
            v.is_floating_point() or not floats) else v
        args, kwargs = tuple(to_meta(a) for a in args), {k: to_meta(v) for k, v in kwargs.items()}
        traced = tuple(to_meta(a, False) for a in args), {k: to_meta(v, False) for k, v in kwargs.items()}
    holders = contextlib.ExitStack()  # the holders' optional arguments, while the program is made
    with holders, eval_mode(model), graph_friendly(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with conversions_in_place(), copies_in_program(), stacked_index_lists():
                ep, branched, found = traced_with_holders(model, traced, _export(model, traced, on_meta),
                                                          lambda: _export(model, traced, on_meta), holders)
        except Exception as e:  # noqa: BLE001 - report any tracing failure uniformly
            raise (UnsizedOnMeta if on_meta and _data_dependent(e) else TraceError)(
                f"torch.export could not trace {type(model).__name__}: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                f"Hint: {_hint(model, args, kwargs)}") from e
        if on_meta:
            _constants_from_fake_twin(ep, model, *given)
        unread = unread_parameters(ep)  # before the decompositions drop dead code
        for _ in range(3 if decompose else 0):
            table, retrace = _unruled_decomposable(ep)
            if not table and not retrace:
                break
            with real_values() if branched else contextlib.nullcontext():  # its values' real ones
                ep = ep.run_decompositions(table)
        if has_data_dependent_sizes(ep) and (on_meta or not concretize(ep, *traced)):
            _refuse_unsized(ep, model, on_meta)
        ep.graph_module.meta[BRANCHES_TAKEN] = branched
        ep.graph_module.meta[UNREAD] = unread
        ep.graph_module.meta[HOLDERS] = found
    ep.graph_module.meta[DEAD] = proven_dead(model, unread)  # as defined: outside graph_friendly
    return ep, args, kwargs


def _refuse_unsized(ep, model, on_meta: bool) -> None:
    """Raise :class:`TraceError` (on ``meta``: :class:`UnsizedOnMeta`, which an out-of-core
    merge answers by loading its models) where a value the analysis sizes (any but the driver's ignored
    ops') still has a size only the data decides (``nonzero``, a boolean mask's selection):
    on ``meta`` no value is at hand, and elsewhere the program could not be run on the example
    inputs to take it (:func:`.concrete.concretize`). None otherwise."""
    from .concrete import unsized_nodes
    from .driver import IGNORED
    left = [n for n in unsized_nodes(ep) if n.op == "placeholder" or packet(n) not in IGNORED]
    if not left:
        return
    where = left[0].meta.get("stack_trace", "").strip().splitlines()
    raise (UnsizedOnMeta if on_meta else TraceError)(
        f"{type(model).__name__}: the size of {left[0].name} ({len(left)} value(s) in all) depends on the "
        f"data{' (' + where[-2].strip() + ')' if len(where) > 1 else ''}, and "
        + ("a model on the meta device holds no values to take it from; expected the model with its weights "
           "(load it on the CPU)" if on_meta else
           "the program could not be run on the example inputs to take it; expected inputs it runs on"))


def _fields(tree) -> list:
    if hasattr(tree, "keys"):
        return list(tree.keys())
    return list(range(len(tree))) if isinstance(tree, (list, tuple)) else []


def select_outputs(out, names):
    """The parts of a model output ``out`` named in ``names`` (keys of a dict or model
    output, positions of a tuple), in that order; ``out`` itself for None."""
    if names is None:
        return out
    fields = _fields(out)
    missing = [n for n in names if n not in fields]
    if missing:
        raise InputError(f"outputs={list(names)}: the model has no output {missing[0]!r}; "
                         f"expected some of {fields}")
    return [out[n] for n in names]


def output_positions(ep, names):
    """Positions among the exported graph's flat outputs of the outputs named in ``names``
    (see :func:`select_outputs`), or None for all."""
    if names is None:
        return None
    from torch.utils import _pytree as pytree
    spec = ep.call_spec.out_spec
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    return frozenset(pytree.tree_leaves(select_outputs(tree, names)))


def head_outputs(ep):
    """The default outputs of a head model (an output with ``logits`` in its name): its fields
    other than hidden states (:data:`HIDDEN_OUTPUTS`: an encoder-decoder's
    ``encoder_last_hidden_state``, a tower's ``text_model_output``, a vision-language
    model's ``image_outputs``), as names; None (every
    output) for any other model, or when nothing would be left out."""
    from torch.utils import _pytree as pytree
    spec = ep.call_spec.out_spec
    fields = _fields(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
    if not any(isinstance(f, str) and "logits" in f for f in fields):
        return None
    keep = tuple(f for f in fields if not (isinstance(f, str) and f.endswith(HIDDEN_OUTPUTS)))
    return keep if len(keep) < len(fields) else None


def flatten_outputs(out) -> list:
    """The floating-point tensors of a model's output (tensors, dicts, model outputs, tuples)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict) or hasattr(out, "items"):
        return [t for v in out.values() for t in flatten_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in flatten_outputs(v)]
    return []


def output_deviation(base: list, out: list) -> float:
    """The largest relative change ``‖a − b‖ / ‖a‖`` over paired outputs (float64 norms); NaN
    when either side holds a NaN or inf (no deviation is measured: never 0 by ``max`` skipping
    a NaN)."""
    worst = 0.0
    for a, b in zip(base, out):
        a, b = a.double(), b.double()
        d = float((a - b).norm()) / max(float(a.norm()), 1e-30)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()) or d != d:
            return float("nan")
        worst = max(worst, d)
    return worst

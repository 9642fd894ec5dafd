"""Values a submodule would compute from its data, computed before the trace by transformers' own
export support (:func:`transformers.exporters.utils.precompute_export_inputs`) and handed to that
submodule while ``torch.export`` traces (see :mod:`.trace`).

A vision encoder that packs images of any size into one sequence computes its attention segments
(``cu_seqlens``), its patches' positions and interpolation taps from each image's grid with loops
over ``.tolist()``, ``repeat_interleave`` and ``cumsum``: no symbolic trace follows them, and the
real-value propagation :func:`.trace.trace` falls back on trips on torch's own ``cumsum``
decomposition (its fake and real dtypes differ). transformers lets those values be passed in
(``transformers.vision_utils``: each ``get_vision_*`` pops its value from the encoder's keyword
arguments), and its exporter computes them from the inputs the encoder receives. Here the model
runs once with every submodule's call recorded; the values transformers precomputes for a call
are handed to that submodule, at that call, while tracing: in the encoder's own keyword arguments,
so a name the text model also takes (``position_ids``) never clashes. The values depend on the
example's sizes only, never on a parameter. transformers' own patches for ``torch.export`` are in
place meanwhile (its exporter's ``apply_patches("dynamo")``: a packed vision attention's loop over
segments as one batched attention). The forward with both is checked to return what it returns
without them; else nothing is handed over.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["precomputed_inputs"]


def _exporter():
    """transformers' ``precompute_export_inputs`` and its ``torch.export`` patches (a context
    manager), or None without its exporters."""
    try:
        import transformers.exporters.exporter_dynamo  # noqa: F401 - registers the dynamo patches
        from transformers.exporters.utils import apply_patches, precompute_export_inputs
    except Exception:  # noqa: BLE001 - a transformers without exporters: nothing precomputed
        return None
    return precompute_export_inputs, lambda: apply_patches("dynamo")


def _takes_keywords(module) -> inspect.Signature | None:
    """The signature of ``module``'s forward when it takes arbitrary keyword arguments."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return sig if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) else None


def _bound(sig, args, kwargs) -> inspect.BoundArguments | None:
    try:
        return sig.bind(*args, **kwargs)
    except TypeError:
        return None


def _named(sig, ba) -> dict:
    """A call's arguments by name: the named ones and those in its ``**kwargs``."""
    out = {}
    for k, v in ba.arguments.items():
        if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(v)
        elif sig.parameters[k].kind is not inspect.Parameter.VAR_POSITIONAL:
            out[k] = v
    return out


@contextlib.contextmanager
def _hooks(model, hook):
    """``hook(module, sig, args, kwargs)`` before every call of every submodule of ``model``
    whose forward takes ``**kwargs``."""
    handles = []
    for m in model.modules():
        sig = _takes_keywords(m) if m is not model else None
        if sig is not None:
            handles.append(m.register_forward_pre_hook(
                lambda mod, a, k, sig=sig: hook(mod, sig, a, k), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _calls(model, args, kwargs) -> tuple:
    """``(module, its arguments by name)`` for every call the forward makes of a submodule that
    takes ``**kwargs``, in order; and the forward's output."""
    calls: list = []

    def record(mod, sig, a, k):
        ba = _bound(sig, a, k)
        if ba is not None:
            calls.append((mod, _named(sig, ba)))
    with _hooks(model, record), torch.no_grad():
        out = model(*args, **kwargs)
    return calls, out


def _extras(calls, precompute) -> dict:
    """Per module, per call of it: the values transformers precomputes for that call that the
    call was not given (an empty dict for a call with none)."""
    extras: dict = {}
    for mod, given in calls:
        inputs = dict(given)
        try:
            with torch.no_grad():
                precompute(mod, inputs)
        except Exception:  # noqa: BLE001 - a call transformers cannot precompute for
            inputs = given
        # new values, and a tensor replaced by its Python values (``image_sizes`` as ints)
        new = {k: v for k, v in inputs.items() if v is not None and (
            given.get(k) is None or (torch.is_tensor(given[k]) and not torch.is_tensor(v)))}
        extras.setdefault(id(mod), []).append(new)
    return {k: v for k, v in extras.items() if any(v)}


def _injector(extras):
    """A pre-hook handing each call its precomputed values (the n-th call of a module the n-th
    call's), and the counters a new forward resets."""
    seen = {}

    def hook(mod, sig, a, k):
        per_call = extras.get(id(mod))
        if not per_call:
            return None
        i = seen.get(id(mod), 0)
        seen[id(mod)] = i + 1
        new = per_call[i % len(per_call)]
        if not new:
            return None
        # a value for an argument given by position replaces it there; any other is a keyword
        names = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        a, k = list(a), dict(k)
        for key, v in new.items():
            at = names.index(key) if key in names else len(a)
            if at < len(a):
                a[at] = v
            else:
                k[key] = v
        return tuple(a), k
    return hook, seen


def _same(a, b, flatten, narrowest) -> bool:
    """The same outputs up to round-off relative to each output's largest value (transformers'
    patched kernels sum in another order: MuseSpark's logits move by 1.6e-6 of 2.6 in float32, a
    bfloat16 vision-language model's by up to one bfloat16 epsilon, 2⁻⁷, float32 logits
    included): 1e-5 for a model of float32 or float64, sixteen epsilons of ``narrowest`` (the
    narrowest floating dtype of its parameters) for a narrower one; else a bfloat16 model would
    be handed nothing, and its report would differ from its float32 one's."""
    xs, ys = flatten(a), flatten(b)
    scale = [max(1.0, float(x.abs().max())) if x.numel() else 1.0 for x in xs]
    tol = max(1e-5, 16 * torch.finfo(narrowest).eps)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=tol, atol=tol * s, equal_nan=True)
        for x, y, s in zip(xs, ys, scale))


def _narrowest(model) -> torch.dtype:
    """The floating dtype of ``model``'s parameters with the largest epsilon (float32: none)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} or {torch.float32}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


@contextlib.contextmanager
def precomputed_inputs(model, args, kwargs, flatten):
    """While inside, each submodule call of ``model``'s forward on ``args``/``kwargs`` receives
    the values transformers precomputes for it, and transformers' own ``torch.export`` patches
    (``apply_patches("dynamo")``: packed vision attention as one batched attention, SDPA's math
    kernel on the CPU) are in place; yields whether (not: transformers has no exporters, the
    forward fails eagerly, or returns anything else with them: ``flatten`` makes an output its
    floating-point tensors)."""
    exporter = _exporter()
    try:
        calls, base = _calls(model, args, kwargs) if exporter else ([], None)
    except Exception:  # noqa: BLE001 - a forward that does not run eagerly: nothing to hand over
        calls = []
    if not calls:
        yield False
        return
    inject, seen = _injector(_extras(calls, exporter[0]))
    reset = model.register_forward_pre_hook(lambda *_: seen.clear())
    try:
        with exporter[1](), _hooks(model, inject):
            try:
                with torch.no_grad():
                    ok = _same(base, model(*args, **kwargs), flatten, _narrowest(model))
            except Exception:  # noqa: BLE001 - the forward refuses them: nothing handed over
                ok = False
            if ok:
                yield True
        if not ok:
            yield False
    finally:
        reset.remove()

"""The devices symgraph computes on: a device name checked to hold a tensor before any work;
modules built with every parameter on ``meta``, and weightless twins of a model."""
from __future__ import annotations

import contextlib

__all__ = ["NO_COMPUTE_DEVICES", "computed_buffers", "meta_model", "parameters_on_meta", "usable_device",
           "weightless_twin"]

#: Device types that hold no values (every other one is checked to hold a tensor before a merge).
NO_COMPUTE_DEVICES = ("meta",)


def usable_device(name: str) -> str:
    """``name`` as torch spells the device (``cuda:0``), or a ``ValueError`` saying why symgraph
    cannot compute there (what a schema's validator turns into one line): not a device name, a
    device without values (``meta``), CUDA on a machine without it, or a device that cannot hold
    a tensor in this torch build."""
    import torch
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError("is not a device name; expected 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type in NO_COMPUTE_DEVICES:  # a meta tensor has a shape and no values: nothing to compute with
        raise ValueError(f"is not a device symgraph computes on ({dev.type} tensors hold no values); expected "
                         "'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("names a CUDA device but this machine has none (torch.cuda.is_available() is "
                         "False); expected 'cpu', or a machine with a GPU and a CUDA build of torch")
    if dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except Exception as e:  # noqa: BLE001 - no backend (xla, ipu), not compiled in (xpu), no module (hpu)
            said = " ".join(str(e).split()).split(". ")[0][:120]  # the first sentence
            raise ValueError(f"cannot hold a tensor ({type(e).__name__}: {said}); "
                             "expected 'cpu', 'cuda', 'cuda:N' or another device this torch build "
                             "has") from None
    return str(dev)


_BUILT: dict = {}  # (class, its config as JSON) -> the buffers it computes: the last few


def computed_buffers(cls, config) -> dict:
    """``{name: tensor}`` of the buffers ``cls(config)`` computes on the CPU, built with every
    parameter on ``meta`` as it is registered (:func:`parameters_on_meta`: no weight memory, no
    initialisation work). Kept for the last few classes and configs (read, never written): a
    merge asks once per checkpoint and once per analysis of one on ``meta`` (1.35 s each for a
    1.1B Llama config)."""
    key = (cls, config.to_json_string()) if hasattr(config, "to_json_string") else None
    if key is not None and key in _BUILT:
        return _BUILT[key]
    with parameters_on_meta():
        model = cls(config)
    out = {n: b for n, b in model.named_buffers(remove_duplicate=False) if not b.is_meta}
    if key is not None:
        while len(_BUILT) >= 4:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = out
    return out


@contextlib.contextmanager
def parameters_on_meta():
    """While inside, every parameter a module registers is put on the ``meta`` device as it is
    registered. ``torch.device("meta")`` alone misses a parameter made by a legacy constructor
    (``nn.Parameter(torch.FloatTensor(n))``: XLNet's attention and mask embedding), which ignores
    the default device: the model would hold it on the CPU beside the others on meta, and no
    trace of it could run (meta and cpu tensors in one op)."""
    import torch
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    # a deliberate monkeypatch for the length of the block, restored below
    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # scoped patch
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]  # restore


def meta_model(cls, config):
    """``cls(config)`` built on the ``meta`` device with every parameter there (a legacy
    constructor's too, moved as it is registered: :func:`parameters_on_meta`): a skeleton of
    shapes and ties that holds no weights (the checkpoint loader's model, resizing's shape
    probes, the circuit-space models)."""
    import torch
    with torch.device("meta"), parameters_on_meta():
        return cls(config)


def weightless_twin(model, device="meta"):
    """A copy of ``model`` whose parameters and buffers are empty tensors of their shapes and
    dtypes (tied ones still tied; no weight copied): on ``meta``, or fake tensors on another
    ``device`` (a ``FakeTensorMode``'s: no memory, yet a trace on them computes its constants
    for real). Whatever a method run on the twin does to it leaves the model's own unchanged."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    fake = torch.device(device).type != "meta"
    memo: dict = {}
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in memo:
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                memo[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)

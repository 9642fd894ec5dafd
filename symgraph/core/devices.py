"""The devices symgraph computes on: a device name checked to hold a tensor before any work."""
from __future__ import annotations

__all__ = ["NO_COMPUTE_DEVICES", "usable_device"]

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

"""Concrete sizes for the values whose size depends on the data (a boolean mask's selection:
BART's and T5's sequence classification heads pick the hidden state at each row's end-of-sequence
token). ``torch.export`` leaves such sizes symbolic (unbacked); the analysis is of the example
inputs anyway, so the program is run once on them and each such value's size is the one it
took. The axes of those sizes are data's (token positions): the rules fix them."""
from __future__ import annotations

import torch

__all__ = ["has_data_dependent_sizes", "unsized_nodes", "concretize"]


def _unbacked(v) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    if isinstance(v, (list, tuple)):
        return any(_unbacked(x) for x in v)
    return isinstance(v, torch.Tensor) and bool(free_unbacked_symbols(v))


def has_data_dependent_sizes(ep) -> bool:
    return any(_unbacked(n.meta.get("val")) for n in ep.graph.nodes)


def unsized_nodes(ep) -> list:
    """The nodes of ``ep`` whose value's size the data decides (unbacked)."""
    return [n for n in ep.graph.nodes if _unbacked(n.meta.get("val"))]


def _meta_like(v, got):
    if isinstance(v, (list, tuple)) and isinstance(got, (list, tuple)) and len(v) == len(got):
        return type(v)(_meta_like(a, b) for a, b in zip(v, got))
    if isinstance(v, torch.Tensor) and isinstance(got, torch.Tensor):
        return torch.empty(tuple(got.shape), dtype=v.dtype, device="meta")
    return v


def concretize(ep, args, kwargs) -> bool:
    """Give every value of ``ep`` whose size depends on the data the size it takes on
    ``args``/``kwargs`` (a meta tensor of that shape). False (nothing changed) when the
    program cannot be run on them (a model on ``meta``) or a value is missing."""
    wanted = {n.name: n for n in unsized_nodes(ep)}
    if not wanted:
        return True
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
        return False
    got: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name in wanted:
                got[n.name] = out
            return out

    try:
        with torch.no_grad():
            Recorder(ep.module()).run(*_flat_user_inputs(ep, args, kwargs))
    except Exception:  # noqa: BLE001 - the symbolic sizes stay; the driver fixes what it cannot size
        return False
    if set(got) != set(wanted):
        return False
    for name, node in wanted.items():
        node.meta["val"] = _meta_like(node.meta["val"], got[name])
    return True


def _flat_user_inputs(ep, args, kwargs) -> list:
    """The unlifted module's flat inputs: the leaves of ``(args, kwargs)``, as at export (the
    same objects were exported, so the same order)."""
    from torch.utils import _pytree as pytree
    return pytree.tree_leaves((args, kwargs))

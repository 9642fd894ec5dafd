"""Graph helpers shared by the passes: op packets, the nodes an argument list mentions, the
nodes whose values reach an output, and where a node came from (module, source line)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BRANCHES_TAKEN", "HIDDEN_OUTPUTS", "UNREAD", "UNSAVED", "unsaved_tensors", "unsaved_values", "FrozenOp", "READ_AS_NUMBER", "flat_nodes", "live_nodes", "module_path", "ndim", "op_of", "output_nodes", "packet", "packets",
           "source_line", "tensor_axes", "unread_parameters"]

# Output fields that are hidden states, not what a head computes (matched at the name's end).
HIDDEN_OUTPUTS = ("hidden_state", "hidden_states", "attentions", "past_key_values", "_model_output",
                  "_outputs")


def packet(t):
    """The op packet (``aten.mul`` for ``aten.mul.Tensor``) of an op or of a graph node's
    target; anything else (a placeholder's name, a Python callable) is returned as it is."""
    t = t.target if isinstance(t, torch.fx.Node) else t
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else t


def op_of(node):
    """The op packet a graph node calls; None for anything that is not a node (constants)."""
    return packet(node) if isinstance(node, torch.fx.Node) else None


def packets(names: str) -> set:
    """The ATen packets named in a space-separated list (names this torch lacks are skipped)."""
    aten = torch.ops.aten
    return {getattr(aten, n) for n in names.split() if hasattr(aten, n)}


def ndim(node):
    """The number of dimensions of a node's tensor value, or None for other values."""
    v = node.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else None


def flat_nodes(args):
    out = []
    for a in args:
        if isinstance(a, torch.fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += flat_nodes(a)
        elif isinstance(a, dict):
            out += flat_nodes(list(a.values()))
    return out


@dataclass
class FrozenOp:
    """An op whose axes are fixed, and why: it has no symmetry rule, or its rule failed on
    it (paired axes of different sizes: a rule bug, reported rather than raised)."""
    op: str
    node: str
    module: str
    source: str
    axes: list = field(default_factory=list)
    why: str = "no rule"

    def to_dict(self):
        out = {"op": self.op, "node": self.node, "module": self.module, "source": self.source}
        return out if self.why == "no rule" else {**out, "why": self.why}


def module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def _clean_path(path: str) -> str:
    # torch.export spells submodule paths like "L['self'].layers[0]" or "layers.0"
    path = path.replace("L['self'].", "").replace("L['self']", "")
    for ch in "[]":
        path = path.replace(ch, "." if ch == "[" else "")
    return path.strip(".")


def source_line(node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            return lines[i] + (" | " + lines[i + 1] if i + 1 < len(lines) else "")
    return ""


#: ops that hand a tensor's value to Python as a number (a branch or a size is taken on it)
READ_AS_NUMBER = {torch.ops.aten._local_scalar_dense}
BRANCHES_TAKEN = "symgraph_branches_taken"  # graph meta: data-dependent branches traced as taken
UNREAD = "symgraph_unread"  # graph meta: parameters the program as exported never reads
UNSAVED = "symgraph_unsaved"  # graph meta: parameters the model's save_pretrained leaves out


def unsaved_tensors(ep) -> dict:
    """``{name: why}`` of the parameters and buffers a checkpoint of the model does not store:
    reloading recomputes them in their first basis, so no symmetry may move them (a model
    transformed, saved and loaded again must compute what it did). Non-persistent buffers
    (Speech2Text's sinusoidal positions) and the parameters the model's ``save_pretrained``
    leaves out (``_keys_to_ignore_on_save``: Marian's sinusoidal positions; kept as ``UNSAVED``
    by :func:`symgraph.report.api.analyze`)."""
    why = dict.fromkeys(ep.graph_signature.non_persistent_buffers, "a non-persistent buffer")
    why |= dict.fromkeys(ep.graph_module.meta.get(UNSAVED, ()), "the model's _keys_to_ignore_on_save")
    return {n: f"{n} is not saved with the model ({w}): reloading recomputes it, so no symmetry may move it"
            for n, w in why.items()}


def unsaved_values(ep, model) -> None:
    """Give ``ep`` (``model`` on ``meta`` traced) the values of its non-persistent buffers as
    ``model``'s class computes them from its config (with its parameters on ``meta``: only the
    buffers take memory), so the analysis reads them as it reads a real model's; where the
    model cannot be built again they stay unknown (and fix what they meet)."""
    from ..core.devices import computed_buffers
    names = [n for n in ep.graph_signature.non_persistent_buffers if getattr(ep.constants.get(n), "is_meta", False)]
    if not names or getattr(model, "config", None) is None:
        return
    try:
        built = computed_buffers(type(model), model.config)
    except Exception:  # noqa: BLE001 - a class that needs more than its config: values unknown
        return
    for n in names:
        v = built.get(n)
        if isinstance(v, torch.Tensor) and not v.is_meta and v.shape == ep.constants[n].shape:
            ep.constants[n] = v


def live_nodes(graph, keep=None) -> set:
    """Nodes whose values can reach the graph's output (only the outputs at the positions in
    ``keep``, when given). A value used only for its shape (``embed_positions(x[:, :, -1])``)
    is dead after export and constrains nothing. Ops that mutate an argument count as live,
    with everything they read, and so does every value the program reads as a number
    (``_local_scalar_dense``: ``.item()``, a branch or a size taken on it): it is an output."""
    live, stack = set(), []
    for n in graph.nodes:
        t = n.target
        if n.op == "output":
            live.add(n)
            stack += [o for i, o in enumerate(output_nodes(n))
                      if o is not None and (keep is None or i in keep)]
        elif isinstance(t, torch._ops.OpOverload) and (t._schema.is_mutable or t.overloadpacket in READ_AS_NUMBER):
            stack.append(n)
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack += n.all_input_nodes
    return live


def unread_parameters(ep) -> list:
    """Names of the parameters no node of ``ep`` reads; a name tied to a tensor the program
    reads under another name (export routes every use to one) is read. On the program as
    exported (:func:`.trace.trace` keeps it as ``UNREAD``): the decompositions drop dead code,
    and a value computed then dropped (a pooler's) is read."""
    sd, sig = ep.state_dict, ep.graph_signature.inputs_to_parameters
    nodes = {sig[n.name]: n for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig}
    read = {id(sd[n]) for n, node in nodes.items() if node.users and n in sd}
    return [n for n, node in nodes.items() if not node.users and (n not in sd or id(sd[n]) not in read)]


def output_nodes(node) -> list:
    """The graph output node's values in pytree-leaf order (None where not a node)."""
    outs = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else node.args
    return [o if isinstance(o, torch.fx.Node) else None for o in outs]


def tensor_axes(ax) -> list:
    """A node's axes as a list per output tensor (one for a single tensor; None skipped)."""
    if ax is None:
        return []
    return [t for t in ax if t is not None] if (ax and isinstance(ax[0], list)) else [ax]

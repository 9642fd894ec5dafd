"""Exported graphs run op by op: a capturing interpreter, :class:`Stepper` (a generator of
chosen outputs that reads each weight when an op takes it, and can pause and resume), two runs
in lockstep, and :class:`GraphRunner` (a graph as a module over a state dict). Used by the
activation statistics (:mod:`.activations`), REPAIR and RegMean, and the out-of-core barrier."""
from __future__ import annotations

from collections import Counter

import torch

from ..core.gemm import graph_op
from ..errors import InputError, NeedsMemory

__all__ = ["run_capture", "GraphRunner", "Stepper", "lockstep", "on_device", "meta_constants",
           "streamed_outputs", "flatten_for", "runnable"]


class _Run(torch.fx.Interpreter):
    """A graph run: half-precision products where the CPU has no fast kernel for them go
    through :func:`~symgraph.core.gemm.graph_op` (in float32, rounded once)."""

    def call_function(self, target, args, kwargs):
        return super().call_function(graph_op(target, args), args, kwargs)


class _Capture(_Run):
    def __init__(self, gm, names, sink):
        super().__init__(gm)
        self.names, self.sink = names, sink

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.sink(n.name, out)
        return out


def meta_constants(gm) -> list:
    """Tensor attributes of ``gm`` that are neither parameters nor buffers and hold no values
    (traced on ``meta``: constants the forward created, such as index tensors)."""
    import operator
    named = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    named |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in named:
            t = operator.attrgetter(node.target)(gm)
            if isinstance(t, torch.Tensor) and t.is_meta:
                out.append(node.target)
    return out


def runnable(gm, device):
    """``gm`` (a traced graph module, maybe traced on ``meta``) ready to run op by op on
    ``device``, its weights read when an op takes them: :func:`on_device` (in place), and
    :class:`NeedsMemory` when it holds constants the forward created that a model traced
    without weights does not have (:func:`meta_constants`). Every op-by-op run starts here."""
    on_device(gm, device)
    lost = meta_constants(gm)
    if lost:
        raise NeedsMemory(f"the traced graph creates tensor constants ({', '.join(lost[:3])}) whose values a "
                          "model traced without weights (on meta) does not hold")
    return gm


def on_device(gm, device):
    """``gm`` (changed in place) computing on ``device``: an exported graph has the tracing
    device written into its ops (``device=`` arguments, tensor-metadata assertions, also in
    the subgraphs of higher-order ops); the assertions, which compute nothing, are dropped,
    and devices are rewritten."""
    device = torch.device(device)
    swap = lambda x: device if isinstance(x, torch.device) and x != device else x  # noqa: E731
    import operator
    named = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    named |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:  # tensor constants the forward created (index lists) go along
        if node.op == "get_attr" and node.target not in named:
            t = operator.attrgetter(node.target)(gm)
            if isinstance(t, torch.Tensor) and not t.is_meta and t.device != device:
                owner, _, attr = node.target.rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, attr, t.to(device))
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in list(sub.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
                sub.graph.erase_node(node)
                continue
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        sub.recompile()
    return gm


class _Lazy:
    """A graph attribute not read yet (its name)."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


class Stepper(_Run):
    """An exported graph (``ExportedProgram.module()``) run op by op as a generator of chosen
    outputs. With ``fetch`` (``name -> tensor``), each parameter or buffer is read when an op
    takes it and dropped when the op is done: memory holds the live activations and one op's
    weights, so a graph traced on ``meta`` runs on tensors streamed from a checkpoint."""

    def __init__(self, gm, fetch=None):
        super().__init__(gm)
        self.fetch = fetch
        self._order = list(self.graph.nodes)
        self._paused = None  # (live values, inputs, next position) of a run paused by steps(stop=)
        self.lazy = set()
        self.dtypes = {}  # the dtype the graph was traced with, per tensor: a fetched tensor stored
        if fetch is not None:  # narrower (models saved in different dtypes) is cast up to it
            named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
            self.lazy = {n for n, _ in named}
            self.dtypes = {n: t.dtype for n, t in named if t.is_floating_point()}

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.view.default:  # a view traced on one layout, run on another
            target = torch.ops.aten.reshape.default  # (a matmul under autograd): the same view where it can
        return super().call_function(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        if target in self.lazy:
            return _Lazy(target)
        return super().get_attr(target, args, kwargs)

    def fetch_args_kwargs_from_env(self, n):
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        if not self.lazy:
            return args, kwargs
        load = lambda x: self._load(x.name) if isinstance(x, _Lazy) else x  # noqa: E731
        return torch.fx.node.map_aggregate(args, load), torch.fx.node.map_aggregate(kwargs, load)

    def _load(self, name):
        t = self.fetch(name)
        want = self.dtypes.get(name)
        if want is None or not t.is_floating_point() or torch.finfo(t.dtype).bits >= torch.finfo(want).bits:
            return t
        return t.to(want)  # a narrower stored tensor in a wider graph (models stored in different dtypes)

    def live(self, node):
        """The value of graph node ``node`` in a paused run (an input of the node it paused
        before, or any other value still in use)."""
        if self._paused is None:
            raise RuntimeError("the run is not paused")
        return self._paused[0][node]

    def rerun(self, node) -> None:
        """Compute ``node`` again in a paused run, its parameters read again (one corrected since)."""
        if self._paused is None:
            raise RuntimeError("the run is not paused")
        env = self._paused[0]
        gone = [i for i in node.all_input_nodes if i not in env]  # the weight's own node, freed after its use
        if any(i.op != "get_attr" for i in gone):
            raise RuntimeError(f"{node.name}'s inputs are no longer live")
        for i in gone:
            env[i] = self.run_node(i)
        env[node] = self.run_node(node)
        for i in gone:
            del env[i]

    @property
    def position(self) -> int:
        """Where the next call of :meth:`steps` starts (0: a new run)."""
        return self._paused[2] if self._paused is not None else 0

    def steps(self, flat_args, names, stop=None):
        """Run the graph on ``flat_args``; yield ``(node name, output)`` for the nodes in
        ``names`` as they are computed. Values are freed after their last use. ``stop``: pause
        after the node of that name, keeping the live values; the next call resumes there
        (``flat_args`` is then not read again)."""
        if self._paused is None:
            self.env, self.args_iter, start = {}, iter(flat_args), 0
        else:
            self.env, self.args_iter, start = self._paused
        self._paused = None
        for pos in range(start, len(self._order)):
            node = self._order[pos]
            self.env[node] = self.run_node(node)
            if node.name in names and isinstance(self.env[node], torch.Tensor):
                yield node.name, self.env[node].detach()
            for dead in self.user_to_last_uses.get(node, ()):
                del self.env[dead]
            if node.name == stop:
                self._paused = (self.env, self.args_iter, pos + 1)
                return
        self.env.clear()


def lockstep(run_a, run_b, points, drain=False):
    """``((node in A, node in B), value in A, value in B)`` for each pair of ``points`` (in A's
    graph order) as soon as both runs (generators of ``(node name, value)``) have computed it.
    A value is kept until every point that uses it is done; the run that is behind on the first
    open point advances, so with corresponding graphs about one layer's captures are held."""
    need_a, need_b = Counter(a for a, _ in points), Counter(b for _, b in points)
    held_a, held_b = {}, {}
    todo = list(points)
    while todo:
        ready = [p for p in todo if p[0] in held_a and p[1] in held_b]
        if not ready:
            run, held, first = (run_a, held_a, todo[0][0]) if todo[0][0] not in held_a else (run_b, held_b, todo[0][1])
            try:
                name, value = next(run)
            except StopIteration:
                raise RuntimeError(f"the graph ended before computing {first!r}") from None
            held[name] = value
            continue
        for p in ready:
            todo.remove(p)
            yield p, held_a[p[0]], held_b[p[1]]
            for name, need, held in ((p[0], need_a, held_a), (p[1], need_b, held_b)):
                need[name] -= 1
                if not need[name]:
                    del held[name]
    for run in (run_a, run_b):
        if drain:  # run on to its pause point (the last point: nothing more is computed)
            for _ in run:
                pass
        run.close()


def run_capture(gm, names, sink, args, kwargs):
    def put(name, val):
        sink[name] = val.detach()
    # ExportedProgram.module() is a GraphModule whose forward flattens (args, kwargs)
    interp = _Capture(gm, names, put)
    flat = flatten_for(gm, args, kwargs)
    interp.run(*flat)


def streamed_outputs(ep, args, kwargs, fetch) -> list:
    """The flat outputs of exported program ``ep`` (traced on ``meta`` or anywhere) run op by op
    on the CPU, each parameter and buffer read by ``fetch(name)`` when an op takes it (see
    :class:`Stepper`). Raises :class:`NeedsMemory` when the graph holds constants a model
    without weights does not have."""
    gm = runnable(ep.module(), "cpu")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    import torch.utils._pytree as pytree
    flat_out, _ = pytree.tree_flatten(out.args[0])
    names = [n.name for n in flat_out if isinstance(n, torch.fx.Node)]
    with torch.no_grad():
        got = dict(Stepper(gm, fetch).steps(flatten_for(gm, args, kwargs), set(names)))
    return [got.get(n) for n in names]


def flatten_for(gm, args, kwargs):
    import torch.utils._pytree as pytree
    spec = getattr(gm, "_in_spec", None)
    if spec is not None and spec.num_children == 2:
        kw_spec = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
        keys = kw_spec.context if kw_spec.context else list(kwargs)
        kwargs = {k: kwargs[k] for k in keys if k in kwargs}
    flat, _ = pytree.tree_flatten((args, kwargs))
    return flat


class GraphRunner(torch.nn.Module):
    """An exported graph as a module, so that ``torch.func.functional_call`` runs it (with
    :func:`run_capture`) on any model's tensors, not the ones it was traced with."""

    def __init__(self, gm):
        super().__init__()
        self.gm, self.tied = gm, {}  # tied: id -> (names of the tensor, the tensor, is a buffer)
        for buffer, named in ((False, gm.named_parameters(remove_duplicate=False)),
                              (True, gm.named_buffers(remove_duplicate=False))):
            for name, t in named:
                self.tied.setdefault(id(t), ([], t, buffer))[0].append(name)

    def state(self, tensors: dict) -> dict:
        """``functional_call``'s complete dict: each graph tensor from ``tensors`` under every
        one of its names (tied names get the same tensor). Every parameter must be given;
        a buffer that is not (merge passes parameter states only) is the graph's own, the
        anchor's."""
        out, missing = {}, []
        for names, own, buffer in self.tied.values():
            v = next((tensors[n] for n in names if n in tensors), None)
            if v is None and not buffer:
                missing.append(names[0])
            out.update({f"gm.{n}": own if v is None else v for n in names})
        if missing:
            raise InputError(f"REPAIR was given a model state without parameter(s) {missing[:5]}; "
                             "expected every parameter of the anchor's architecture")
        return out

    def forward(self, names, sink, args, kwargs):
        run_capture(self.gm, names, sink, args, kwargs)



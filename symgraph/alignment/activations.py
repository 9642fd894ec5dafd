"""Similarity of a class from activations (Verma & Elbayad 2024's recipe): the graph is run on each data
batch, the outputs of ops whose rule is marked ``observe`` are captured where a class's
coordinates appear with only fixed classes beside them, and streamed cross-moments of A's and
B's coordinates give a correlation (permutations) or covariance (rotations) matrix. Under
``torch.distributed`` each process streams its own batches and the sums are all-reduced
(:mod:`symgraph.distributed`)."""
from __future__ import annotations

import math
from collections import Counter

import torch

from ..core import distributed
from ..errors import InputError, NeedsMemory
from ..core.groups import orthogonal_part
from .checks import batch_inputs, by_shape

__all__ = ["ActStats", "all_reduce_stats", "activation_similarity", "act_matrix", "run_capture",
           "GraphRunner", "Stepper", "lockstep", "on_device", "streamed_outputs"]


class _Capture(torch.fx.Interpreter):
    def __init__(self, gm, names, sink):
        super().__init__(gm)
        self.names, self.sink = names, sink

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.sink(n.name, out)
        return out


_SUMS = ("sa", "sb", "saa", "sbb", "sab")


class ActStats:
    """Streaming cross-moments of one class's coordinates in A and B: ``n`` samples and the
    sums ``sa``, ``sb`` (``[F, n]``), ``saa``, ``sbb`` and ``sab`` (``[Fa, Fb, n, n]``),
    None before the first sample."""

    def __init__(self):
        self.n = 0
        self.sa = self.sb = self.saa = self.sbb = self.sab = None

    def add(self, xa, xb, nf):
        # xa [N, *F, n] -> flatten fibres
        xa = xa.reshape(xa.shape[0], -1, xa.shape[-1]) if nf else xa.unsqueeze(1)
        xb = xb.reshape(xb.shape[0], -1, xb.shape[-1]) if nf else xb.unsqueeze(1)
        sab = torch.einsum("tai,tbj->abij", xa, xb)
        upd = (xa.sum(0), xb.sum(0), (xa * xa).sum(0), (xb * xb).sum(0), sab)
        if self.sa is None:
            self.sa, self.sb, self.saa, self.sbb, self.sab = upd
        else:
            self.sa, self.sb, self.saa, self.sbb, self.sab = (
                x + y for x, y in zip((self.sa, self.sb, self.saa, self.sbb, self.sab), upd))
        self.n += xa.shape[0]

    def release(self):
        """Drop the sums (``n`` stays, telling that the class was observed)."""
        self.sa = self.sb = self.saa = self.sbb = self.sab = None

    def all_reduce(self) -> "ActStats":
        """Sum ``n`` and the sums over all processes (:func:`all_reduce_stats`); returns
        ``self``."""
        all_reduce_stats({0: self})
        return self

    def matrix(self, kind):
        n = max(self.n, 1)
        ma, mb = self.sa / n, self.sb / n
        cov = self.sab / n - torch.einsum("ai,bj->abij", ma, mb)
        if kind in ("orthogonal", "orthogonal_mean", "gl", "rope"):
            return cov
        sa = (self.saa / n - ma * ma).clamp_min(1e-12).sqrt()
        sb = (self.sbb / n - mb * mb).clamp_min(1e-12).sqrt()
        return cov / torch.einsum("ai,bj->abij", sa, sb)


def all_reduce_stats(stats: dict) -> dict:
    """``{key: ActStats}`` summed over all processes, in place (one reduction for all): a
    process without samples of a class (sums None) counts as zeros of the shapes the others
    have. A no-op when not distributed. Returns ``stats``."""
    if not distributed.is_active():
        return stats
    local = {}
    for i, s in stats.items():
        local[(i, "n")] = s.n
        local.update({(i, f): getattr(s, f) for f in _SUMS if getattr(s, f) is not None})
    total = distributed.all_reduce_dict(local)
    for i, s in stats.items():
        s.n = total[(i, "n")]
        for f in _SUMS:
            setattr(s, f, total.get((i, f)))
    return stats


def activation_similarity(ra, rb, data, pairs, models=None, max_samples=4096, fetch=None,
                          on_done=None, budget=None):
    """Streamed statistics ``{i: ActStats}`` for each ``(group A, group B)`` of ``pairs`` at
    its observation points (ops whose rule is marked ``observe``), over ``data``. Batches of
    other shapes than the traced ones are traced again when ``models`` (A, B) are given.
    A's and B's graphs run side by side, op by op (:class:`Stepper`): a captured output is
    kept only until its counterpart in the other model is computed. ``fetch``: two functions
    ``name -> tensor`` giving each model's parameters and buffers on the CPU, read when an op
    needs one and dropped after it (out of core: the graphs may be traced on ``meta``); None
    runs the graphs' own tensors.

    ``on_done(indices, stats)``, with ``budget`` (bytes): the pairs are taken in passes over
    the data, in the order their last observation point is computed, each pass holding
    statistics of about ``budget`` bytes and running the graphs only as far as its last point;
    after each pass ``on_done`` gets the indices it completed (and may :meth:`ActStats.release`
    them), so that memory holds one pass's statistics rather than every class's (a 7B model's
    MLP classes alone are 32 × 11008² cross-moments). Under ``torch.distributed`` ``data`` is this
    process's shard, and the statistics are summed over all processes before they are
    returned or given to ``on_done`` (every process must call it)."""
    stats = {i: ActStats() for i in range(len(pairs))}
    fa, fb = fetch or (None, None)
    shapes = []
    for (sa, sb), batches in by_shape((ra, rb), models, data):
        spairs = [(sa.groups[ga.id], sb.groups[gb.id]) for ga, gb in pairs]
        plan, views = _plan(sa, sb, spairs)
        gm_a = sa.exported_program.module()
        gm_b = gm_a if sb is sa else sb.exported_program.module()  # a Stepper keeps its own state
        if fetch is not None:  # traced where the models were (maybe meta); fetch reads to the CPU
            for gm in (gm_a,) if gm_b is gm_a else (gm_a, gm_b):
                on_device(gm, "cpu")  # in place
                lost = meta_constants(gm)
                if lost:
                    raise NeedsMemory(f"the traced graph creates tensor constants ({', '.join(lost[:3])}) whose "
                                      "values a model traced without weights (on meta) does not hold")
        order = {name: pos for pos, (name, _, _) in enumerate(sa.nodes())}
        shapes.append((sa, plan, views, gm_a, gm_b, batches, order))
    sa0, plan0, order0 = shapes[0][0], shapes[0][1], shapes[0][-1]
    passes = [list(range(len(pairs)))] if on_done is None else _passes(sa0, plan0, order0, pairs, budget)
    for todo in passes:
        for sa, plan, views, gm_a, gm_b, batches, order in shapes:
            points: dict = {}  # (node in A, node in B) -> [(pair index, its views)]
            for i in todo:
                for node_a, node_b, _ in plan[i]:
                    points.setdefault((node_a, node_b), []).append((i, views[(i, node_a)]))
            if not points:
                continue
            for bi, batch in batches:
                args, kwargs = batch_inputs(sa, batch, bi)
                with torch.no_grad():
                    run_a = Stepper(gm_a, fa).steps(_flatten_for(gm_a, args, kwargs), {a for a, _ in points})
                    run_b = Stepper(gm_b, fb).steps(_flatten_for(gm_b, args, kwargs), {b for _, b in points})
                    in_order = sorted(points, key=lambda p: order[p[0]])
                    for point, xa, xb in lockstep(run_a, run_b, in_order):
                        _add(stats, points[point], xa.double(), xb.double(), max_samples)
        all_reduce_stats({i: stats[i] for i in todo})
        if on_done is not None:
            on_done(todo, stats)
    return stats


def _add(stats, uses, xa, xb, max_samples):
    """One observation point's captures into the statistics of the pairs observed there."""
    for i, (va, vb, k) in uses:
        for (ia, fa), (ib, fb) in zip(va, vb):
            a = _act_gather(xa, k, ia, fa)
            b = _act_gather(xb, k, ib, fb)
            if a.shape[0] > max_samples:
                sel = torch.linspace(0, a.shape[0] - 1, max_samples, device=a.device).long()
                a, b = a[sel], b[sel]
            stats[i].add(a, b, fa)


def _passes(sa, plan, order, pairs, budget):
    """The pair indices in passes: ordered by their last observation point in A's graph
    (``order``: node name -> position), cut where a pass's cross-moments (``[Fa, Fb, n, n]``
    float64) would pass ``budget`` bytes."""
    last = {i: max((order[a] for a, _, _ in plan[i]), default=-1) for i in plan}
    out, size = [[]], 0
    for i in sorted(plan, key=lambda i: (last[i], i)):
        ga = pairs[i][0]
        fibres = math.prod(sa.fibre_shape(ga.id)) if ga.outer else 1
        nbytes = 8 * (fibres * ga.size) ** 2
        if out[-1] and budget is not None and size + nbytes > budget:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
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


def on_device(gm, device):
    """``gm`` (changed in place) computing on ``device``: an exported graph has the tracing
    device written into its ops (``device=`` arguments, tensor-metadata assertions, also in
    the subgraphs of higher-order ops); the assertions, which compute nothing, are dropped,
    and devices are rewritten."""
    device = torch.device(device)
    swap = lambda x: device if isinstance(x, torch.device) and x != device else x  # noqa: E731
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


class Stepper(torch.fx.Interpreter):
    """An exported graph (``ExportedProgram.module()``) run op by op as a generator of chosen
    outputs. With ``fetch`` (``name -> tensor``), each parameter or buffer is read when an op
    takes it and dropped when the op is done: memory holds the live activations and one op's
    weights, so a graph traced on ``meta`` runs on tensors streamed from a checkpoint."""

    def __init__(self, gm, fetch=None):
        super().__init__(gm)
        self.fetch = fetch
        self.lazy = set()
        self.dtypes = {}  # the dtype the graph was traced with, per tensor: a fetched tensor stored
        if fetch is not None:  # narrower (models saved in different dtypes) is cast up to it
            named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
            self.lazy = {n for n, _ in named}
            self.dtypes = {n: t.dtype for n, t in named if t.is_floating_point()}

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

    def steps(self, flat_args, names):
        """Run the graph on ``flat_args``; yield ``(node name, output)`` for the nodes in
        ``names`` as they are computed. Values are freed after their last use."""
        self.env, self.args_iter = {}, iter(flat_args)
        for node in self.graph.nodes:
            self.env[node] = self.run_node(node)
            if node.name in names and isinstance(self.env[node], torch.Tensor):
                yield node.name, self.env[node].detach()
            for dead in self.user_to_last_uses.get(node, ()):
                del self.env[dead]
        self.env.clear()


def lockstep(run_a, run_b, points):
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
        run.close()


def _plan(ra, rb, pairs):
    """Observation points per pair ``{i: [(node in A, node in B, dim)]}`` and the index views
    of each class's coordinates there."""
    plan = {}
    nodes_a, nodes_b = ra.nodes(), rb.nodes()
    for i, (ga, gb) in enumerate(pairs):
        pts = []
        for pos, name_b, k in rb.observation_points(gb.id):
            if pos >= len(nodes_a) or nodes_a[pos][2] != nodes_b[pos][2]:
                continue
            pts.append((nodes_a[pos][0], name_b, k))
        plan[i] = pts
    views = {}
    for i, pts in plan.items():
        ga, gb = pairs[i]
        for node_a, node_b, k in pts:
            va = ra.leaf_views(ra.activation_axes(node_a)[k], ga.id)
            vb = rb.leaf_views(rb.activation_axes(node_b)[k], gb.id)
            need = len(ra.fibre_shape(ga.id))
            # heads on another axis of the tensor, or other leaves mixed in: not a clean view
            ok = [(x, y) for x, y in zip(va, vb)
                  if x[1] == need and x[0].dim() == need + 1 and y[0].dim() == x[0].dim()]
            views[(i, node_a)] = ([x for x, _ in ok], [y for _, y in ok], k)
    return plan, views


def _act_gather(x, k, idx, nf):
    """``x`` gathered along axis ``k`` by ``idx [*F, n, *O]`` → samples ``[N, *F, n]``.

    Every other axis of ``x`` and the other leaves ``O`` of the same axis count as samples.
    """
    moved = x.movedim(k, -1)
    g = moved[..., idx.reshape(-1).to(x.device)].reshape(*moved.shape[:-1], *idx.shape)
    n_o = idx.dim() - nf - 1
    if n_o:
        g = g.movedim(tuple(range(g.dim() - n_o, g.dim())), tuple(range(n_o)))
    keep = idx.shape[: nf + 1]
    return g.reshape(-1, *keep)


def run_capture(gm, names, sink, args, kwargs):
    def put(name, val):
        sink[name] = val.detach()
    # ExportedProgram.module() is a GraphModule whose forward flattens (args, kwargs)
    interp = _Capture(gm, names, put)
    flat = _flatten_for(gm, args, kwargs)
    interp.run(*flat)


def streamed_outputs(ep, args, kwargs, fetch) -> list:
    """The flat outputs of exported program ``ep`` (traced on ``meta`` or anywhere) run op by op
    on the CPU, each parameter and buffer read by ``fetch(name)`` when an op takes it (see
    :class:`Stepper`). Raises :class:`NeedsMemory` when the graph holds constants a model
    without weights does not have."""
    gm = ep.module()
    on_device(gm, "cpu")
    lost = meta_constants(gm)
    if lost:
        raise NeedsMemory(f"the traced graph creates tensor constants ({', '.join(lost[:3])}) whose values a "
                          "model traced without weights (on meta) does not hold")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    import torch.utils._pytree as pytree
    flat_out, _ = pytree.tree_flatten(out.args[0])
    names = [n.name for n in flat_out if isinstance(n, torch.fx.Node)]
    with torch.no_grad():
        got = dict(Stepper(gm, fetch).steps(_flatten_for(gm, args, kwargs), set(names)))
    return [got.get(n) for n in names]


def _flatten_for(gm, args, kwargs):
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


def act_matrix(stats, g, cross):
    if stats.n == 0:
        return None
    kind = orthogonal_part(g.kind)
    m = stats.matrix(kind)  # [Fa, Fb, n, n]
    if kind in ("orthogonal", "orthogonal_mean", "rope") and m.shape[0] > 1:
        n = max(stats.n, 1)
        va = (stats.saa / n - (stats.sa / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        vb = (stats.sbb / n - (stats.sb / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        m = m / (va[:, None, None, None] * vb[None, :, None, None])
    if g.outer or m.shape[0] > 1:
        return m if cross else torch.stack([m[h, h] for h in range(m.shape[0])])
    return m[0, 0]

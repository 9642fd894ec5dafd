"""REPAIR (Jordan et al., ICLR 2023): the math of the merge engine's REPAIR step
(:mod:`~symgraph.merging.repair_stream` runs it, op by op, on the merge as it is written).

Averaging networks, even aligned ones, shrinks the spread of their hidden units ("variance
collapse"). REPAIR measures every repaired channel ``c`` of the parents (in A's basis) and of
the merge on data, and gives the merged channel the interpolated ``μ*_c = Σ_i w_i μ_{i,c}``,
``σ*_c = Σ_i w_i σ_{i,c}`` by an affine change of the layer that produces it
(:func:`correction`; ``μ_c``, ``σ_c`` the merge's)::

    s = σ*_c / σ_c      W'[c] = s · W[c]      b'[c] = s · (b[c] − μ_c) + μ*_c

A layer without a bias is only rescaled, ``s = rms*_c / rms_c``. The channels
(:func:`find_sites`), from the exported graph, never from names: the outputs of a linear or
conv on a parameter weight (used there only) that, through relayouts, casts and affine maps by
constants, reach an elementwise nonlinearity or a product with another learned input-dependent
tensor (a gate), with no normalisation first (a norm, softmax, or a decomposed one: a
reduction combined back with the channel), which would undo it: MLP hidden units and conv
channels before a ReLU; not attention projections, residual writers or convs before a BatchNorm.

Per-channel moments are float64 sums (:class:`Moments`) over every sample, all-reduced under
``torch.distributed``. BatchNorm layers (Ainsworth et al.'s reset) get the population mean and
unbiased variance of their input in the merge (:func:`batchnorm_statistics`).
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field

import torch

from ..core import distributed, finite
from ..errors import InputError
from ..passes.axes import matmul_weight
from ..passes.nodes import packet, packets

__all__ = ["Site", "find_sites", "Moments", "correction", "layer_errors", "batchnorm_layers",
           "batchnorm_statistics", "RepairLayer", "BatchNormReset", "RepairReport"]


aten = torch.ops.aten


# values pass through element for element (maybe a subset, or a cast)
_LAYOUT = packets("view reshape _unsafe_view permute transpose t contiguous clone alias detach "
                   "expand unsqueeze squeeze flatten unflatten split split_with_sizes chunk unbind "
                   "slice select narrow to _to_copy type_as dropout feature_dropout lift_fresh_copy "
                   "_to_dim_order_copy")
_ADD, _MUL, _NEG, _POW = (packets(x) for x in ("add sub rsub", "mul div", "neg positive", "pow"))
# elementwise and nonlinear in their (one) varying input
_NONLINEAR = packets("relu relu_ relu6 gelu silu tanh sigmoid elu selu celu leaky_relu hardtanh "
                      "hardsigmoid hardswish softplus mish prelu _prelu_kernel glu erf erfinv exp "
                      "exp2 expm1 log log1p log2 sin cos tan asin atan arctan sinh cosh asinh abs "
                      "sqrt rsqrt square reciprocal log_sigmoid log_sigmoid_forward clamp clamp_min "
                      "clamp_max threshold hardshrink softshrink logit rrelu sign sgn maximum minimum")
_NORMS = packets("layer_norm native_layer_norm batch_norm native_batch_norm _native_batch_norm_legit "
                  "_native_batch_norm_legit_no_training _native_batch_norm_legit_functional "
                  "cudnn_batch_norm group_norm native_group_norm instance_norm rms_norm "
                  "_fused_rms_norm softmax _softmax log_softmax _log_softmax _safe_softmax")
_REDUCTIONS = packets("mean sum var std var_mean std_mean norm linalg_vector_norm amax amin "
                       "logsumexp max min prod")


# --- which channels ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """One repaired layer: ``weight`` (and ``bias``, or None) produce the channels of graph
    node ``node`` along its dim ``channel_dim``; ``out_dim`` is the weight's output dim."""
    weight: str
    bias: str | None
    node: str
    channel_dim: int
    out_dim: int
    channels: int
    via: str | None = None  # the node that transposes the weight for ``x @ W.T`` (read again once corrected)


def _layer(node, params):
    """``(weight, bias, channel dim of the output, output dim of the weight)`` of a linear map on
    parameters, or None (the weight a node, or the node transposing it for ``x @ W.T``)."""
    t, a = node.target, node.args
    isp = lambda x: isinstance(x, torch.fx.Node) and x.name in params  # noqa: E731
    third = a[2] if len(a) > 2 else node.kwargs.get("bias")
    if node.op != "call_function":
        return None
    if t == aten.linear.default and isp(a[1]):
        w, bias, ch, od = a[1], third, -1, 0
    elif t == aten.addmm.default and isp(a[2]) and node.kwargs.get("beta", 1) == 1 \
            and node.kwargs.get("alpha", 1) == 1:
        w, bias, ch, od = a[2], a[0], -1, 1
    elif (mw := matmul_weight(node, isp)) is not None:  # x @ W, or x @ W.T
        w, bias, ch, od = a[1], None, -1, 1 if mw[1] == "in_out" else 0
    elif (t in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
          or (t == aten.convolution.default and not a[6])) and isp(a[1]):  # a[6]: transposed
        w, bias, ch, od = a[1], third, 1, 0
    else:
        return None
    if bias is not None and not (isp(bias) and bias.meta.get("val") is not None
                                 and bias.meta["val"].dim() == 1):
        return None  # a bias that is not a plain parameter vector: leave the layer alone
    return w, bias, ch, od


def _dependence(graph, sources):
    """Nodes that depend on any of ``sources`` (placeholder names)."""
    dep = set()
    for n in graph.nodes:
        if n.name in sources if n.op == "placeholder" else any(i in dep for i in n.all_input_nodes):
            dep.add(n)
    return dep


def _closure(start, admit):
    """``start`` and every node reached from it through users ``u`` with ``admit(u, closure)``."""
    seen, stack = set(start), list(start)
    while stack:
        for u in stack.pop().users:
            if u not in seen and u.op == "call_function" and admit(u, seen):
                seen.add(u)
                stack.append(u)
    return seen


def _pointwise(p):
    return p in _LAYOUT or p in _ADD or p in _MUL or p in _NEG or p in _NONLINEAR or p in _POW \
        or p is operator.getitem


def _classify(src, varying):
    """``"activation"``, ``"normalised"`` or None for the output of node ``src``."""
    def affine(u, A):  # relayouts, casts, sums of affine values and constants, × or ÷ by constants
        p, n = packet(u), [i for i in u.all_input_nodes if i in A]
        other = [i for i in u.all_input_nodes if i not in A]
        own = sum(a in A for a in u.args if isinstance(a, torch.fx.Node))
        return (p in _LAYOUT or u.target is operator.getitem or p in _NEG
                or (p in _ADD and not any(i in varying for i in other))
                or (p in _MUL and not any(i in varying for i in other) and own == 1
                    and (p == aten.mul or u.args[0] in n))
                or (p in _POW and len(u.args) > 1 and u.args[1] == 1))

    A = _closure({src}, affine)
    found = set()
    for u in {u for n in A for u in n.users if u not in A and u.op == "call_function"}:
        p = packet(u)
        if p in _NORMS:
            found.add("normalised")
        elif p in _NONLINEAR or p in _POW or p in _MUL:
            # a nonlinearity, x·x, c / x, or a product with a learned input-dependent tensor
            # (a gate). ``varying`` holds values that depend on the inputs *and* a parameter:
            # a product with a mask or a rotary table stays affine.
            found.add("activation")
    if "normalised" in found or _decomposed_norm(A, varying):
        return "normalised"
    return "activation" if found else None


def _decomposed_norm(A, varying):
    """Whether a reduction of a value derived elementwise from ``A`` (only) is combined back
    with a value of ``A``: ``x − mean x``, ``x · rsqrt(mean x²)``."""
    P = _closure(A, lambda u, P: _pointwise(packet(u))
                 and all(i in P or i not in varying for i in u.all_input_nodes))
    for r in {u for n in P for u in n.users if packet(u) in _REDUCTIONS}:
        Q = _closure({r}, lambda u, Q: _pointwise(packet(u)))
        if any(i in A for q in Q - {r} for i in q.all_input_nodes):
            return True
    return False


def find_sites(report) -> list:
    """The layers REPAIR corrects in the model of ``report`` (graph order; module docstring)."""
    ep = report.exported_program
    sig, graph = ep.graph_signature, ep.graph
    params = dict(sig.inputs_to_parameters)
    varying = _dependence(graph, set(sig.user_inputs)) & _dependence(graph, set(params))
    out = []
    for node in graph.nodes:
        if (lay := _layer(node, params)) is None:
            continue
        w, b, ch, od = lay
        via = w if w.name not in params else None  # x @ W.T: the transpose, used there only
        w = w.args[0] if via is not None else w
        val, wval = node.meta.get("val"), w.meta.get("val")
        if len(w.users) != 1 or (b is not None and len(b.users) != 1) \
                or val is None or wval is None or val.shape[ch] != wval.shape[od] \
                or _classify(node, varying) != "activation":
            continue  # shared weights produce other channels elsewhere
        out.append(Site(params[w.name], params[b.name] if b is not None else None, node.name,
                        ch if ch >= 0 else val.dim() + ch, od, int(wval.shape[od]),
                        via.name if via is not None else None))
    return out


def batchnorm_layers(model) -> list:
    """Names of the BatchNorm modules of ``model`` with running statistics (registration order)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None]


# --- measuring -------------------------------------------------------------------------------


class Moments:
    """Per-channel float64 sums ``n``, ``s1 = Σx``, ``s2 = Σx²`` at ``key`` (named in refusals)
    of the tensors ``values`` whose channels lie along ``dim``, summed over the processes under
    ``torch.distributed``."""

    def __init__(self, key, values, dim: int):
        self.key = key
        acc: list = [0, 0, 0]  # the count, then float64 sums once a value is added
        for x in values:
            x = x.detach().movedim(dim, -1)
            x = x.reshape(-1, x.shape[-1]).double()
            acc = [acc[0] + x.shape[0], acc[1] + x.sum(0), acc[2] + (x * x).sum(0)]
        if distributed.is_active():
            total = distributed.all_reduce_dict({(key, j): x for j, x in enumerate(acc)
                                                 if j == 0 or isinstance(x, torch.Tensor)})
            acc = [total.get((key, j), x) for j, x in enumerate(acc)]
        self.n, self.s1, self.s2 = acc

    def stats(self) -> tuple:
        """``(mean, std, rms)`` per channel."""
        mean, sq = finite.require_finite("REPAIR", f"the channel statistics at {self.key!r} on the data",
                                         self.s1 / self.n, self.s2 / self.n)
        return mean, (sq - mean * mean).clamp_min(0).sqrt(), sq.sqrt()


def batchnorm_statistics(moments: Moments, module: str) -> tuple:
    """``(mean, unbiased variance, samples)`` per channel of BatchNorm module ``module``'s input,
    whose sums ``moments`` holds; refused with fewer than 2 values per channel."""
    n, s1, s2 = int(moments.n), moments.s1, moments.s2
    if n < 2:
        raise InputError(f"BatchNorm module {module!r} saw {n} value(s) per channel on the data; "
                         "expected at least 2")
    mean = s1 / n
    var = (s2 / n - mean * mean).clamp_min(0) * (n / (n - 1))
    finite.require_finite("REPAIR", f"the input statistics of BatchNorm module {module!r}", mean, var)
    return mean, var, n


# --- the correction --------------------------------------------------------------------------


def correction(site, stats, target) -> dict:
    """``{parameter: f(tensor) -> corrected}`` of ``site``'s weight (and bias): ``W[c] ← s·W[c]``,
    ``b[c] ← s·(b[c] − μ_c) + μ*_c`` (no bias: ``s`` from the rms), in float64, cast back."""
    (mean, std, rms), (t_mean, t_std, t_rms) = stats, target
    m, t = (std, t_std) if site.bias is not None else (rms, t_rms)
    # a channel the merge made constant (relative to the layer's targets) cannot be rescaled
    live = m > 1e-12 * float(t.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
    scale = torch.where(live, t / torch.where(live, m, torch.ones_like(m)), torch.ones_like(m))

    def weight(W):
        shape = [1] * W.dim()
        shape[site.out_dim] = -1
        return (W.double() * scale.to(W.device).reshape(shape)).to(W.dtype)

    def bias(b):
        new = scale * (b.double().to(scale.device) - mean) + t_mean
        return new.to(device=b.device, dtype=b.dtype)

    return {site.weight: weight} | ({site.bias: bias} if site.bias is not None else {})


def layer_errors(stats, target, statistic):
    """``(mean |m/t − 1|, mean |μ − μ*| / σ*)`` over the channels with a positive target, ``m``
    the std (``statistic="std"``) or the root mean square (``"rms"``)."""
    (mean, std, rms), (t_mean, t_std, t_rms) = stats, target
    m, t = (std, t_std) if statistic == "std" else (rms, t_rms)
    ok = t > 0
    if not ok.any():
        return 0.0, 0.0
    return ((m[ok] / t[ok]) - 1).abs().mean().item(), \
        ((mean[ok] - t_mean[ok]).abs() / t_std[ok].clamp_min(1e-30)).mean().item()


# --- the report ------------------------------------------------------------------------------


@dataclass
class RepairLayer:
    """One repaired layer, ``statistic`` ``"std"`` (a bias: mean and std matched) or ``"rms"``;
    ``before`` / ``after``: the channels' mean ``|σ_merged / σ_target − 1|`` (or of the rms),
    ``mean_before`` / ``mean_after``: of ``|μ_merged − μ_target| / σ_target``."""
    weight: str
    bias: str | None
    channels: int
    statistic: str
    before: float
    after: float
    mean_before: float
    mean_after: float


@dataclass
class BatchNormReset:
    """One reset BatchNorm module, measured on ``samples`` values per channel; ``std_ratio``:
    the channels' mean ``σ_data / σ_running`` before the reset (below 1: variance collapsed),
    ``mean_shift``: of ``|μ_data − μ_running| / σ_data``."""
    name: str
    channels: int
    samples: int
    std_ratio: float
    mean_shift: float


@dataclass
class RepairReport:
    """What REPAIR did: ``layers`` (:class:`RepairLayer`, graph order), ``sequential`` (each
    layer measured with every earlier one corrected: always), ``passes`` over the data,
    ``seconds``, ``batchnorm`` (:class:`BatchNormReset`, forward order)."""
    layers: list = field(default_factory=list)
    sequential: bool = True
    passes: int = 0
    seconds: float = 0.0
    batchnorm: list = field(default_factory=list)

    def to_dict(self):
        return asdict(self)  # the layers and BatchNorm modules as dicts too

    def summary(self) -> str:
        n, nb = len(self.layers), len(self.batchnorm)
        bn = f"BatchNorm statistics reset in {nb} layers" if nb else ""
        if not n:
            return f"REPAIR: {bn or 'no channel to repair'}" + (f" ({self.seconds:.1f} s)" if nb else "")
        b, a = (sum(getattr(x, k) for x in self.layers) / n for k in ("before", "after"))
        return (f"REPAIR: {n} layers, {sum(x.channels for x in self.layers)} channels; mean "
                f"|σ/σ*−1| {b:.3g} → {a:.3g}{'; ' + bn if bn else ''} ({self.seconds:.1f} s)")

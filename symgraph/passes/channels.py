"""The channels REPAIR (Jordan et al., ICLR 2023) corrects, found in the exported graph, never
from names (:func:`find_sites`): the outputs of a linear map or conv on a parameter weight (used
there only; ``x @ W.T`` through its transpose too) that, through relayouts, casts and affine maps
by constants, reach an elementwise nonlinearity or a product with another learned input-dependent
tensor (a gate), with no normalisation first (a norm, softmax, or a decomposed one: a reduction
combined back with the channel), which would undo it: MLP hidden units and conv channels before a
ReLU; not attention projections, residual writers or convs before a BatchNorm. The math of the
correction is :mod:`symgraph.merging.repair`'s."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .axes import matmul_weight
from .nodes import packet, packets

__all__ = ["Site", "find_sites"]


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

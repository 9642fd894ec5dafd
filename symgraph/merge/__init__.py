"""Merging: align N models to an anchor, then combine (average, Fisher, RegMean).

Statistics (diagonal Fishers, RegMean Gram matrices) are computed on each model in its own
basis and transformed *together with its weights* into the anchor's basis: a Fisher moves with
the squared map, a Gram ``G = Σ x xᵀ`` of a layer's inputs moves as ``M G Mᵀ``.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from ..align import _batch_inputs, _check_finite, align as _align
from ..errors import InputError
from ..transform import apply_along, axis_matrix

METHODS = ("average", "fisher", "regmean")


def _flat_logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict):
        return next(iter(out.values()))
    raise InputError("cannot find the model's output tensor for Fisher statistics")


def _fisher(model, report, data):
    """Diagonal Fisher of the model's own predictive distribution (labels = its argmax)."""
    params = dict(model.named_parameters())
    fis = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    m = model
    was = m.training
    m.eval()
    try:
        for i, batch in enumerate(data):
            args, kwargs = _batch_inputs(report, batch, i)
            m.zero_grad(set_to_none=True)
            logits = _flat_logits(m(*args, **kwargs)).float()
            logp = torch.log_softmax(logits, -1)
            loss = -(logp.gather(-1, logp.argmax(-1, keepdim=True))).sum()
            loss.backward()
            for k, p in params.items():
                if p.grad is not None:
                    fis[k] += p.grad.detach().double() ** 2
        m.zero_grad(set_to_none=True)
    finally:
        m.train(was)
    return fis


def _linear_inputs(an):
    """(weight fqn, input node, weight layout) for each linear-like op on a parameter."""
    aten = torch.ops.aten
    out = []
    rev = {n: k for k, n in an.param_nodes.items()}
    for node in an.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.linear.default and node.args[1] in rev:
            out.append((rev[node.args[1]], node.args[0], "out_in"))
        elif node.target == aten.addmm.default and node.args[2] in rev:
            out.append((rev[node.args[2]], node.args[1], "in_out"))
    return out


def _grams(report, data):
    from ..align import _run_capture
    an = report._analysis
    lin = _linear_inputs(an)
    names = {x.name for _, x, _ in lin}
    gm = an.ep.module()
    grams = {}
    for i, batch in enumerate(data):
        args, kwargs = _batch_inputs(report, batch, i)
        cap = {}
        with torch.no_grad():
            _run_capture(gm, names, cap, args, kwargs)
        for w, x, _ in lin:
            if x.name not in cap:
                continue
            X = cap[x.name].double().reshape(-1, cap[x.name].shape[-1])
            grams[w] = grams.get(w, 0) + X.T @ X
    return grams, lin


def merge(models, inputs=None, *, weights=None, align="weights", data=None, method="average",
          anchor: int = 0, solver=None, inner="procrustes", regmean_alpha: float = 0.9,
          return_alignments: bool = False):
    """Merge ``models`` (N ≥ 2) into a new model of the anchor's architecture.

    align : "weights" (data-free), "activations" (needs ``data``) or None (no alignment).
    method : "average", "fisher" or "regmean" (the last two need ``data``).
    weights : per-model mixing weights (default uniform).
    """
    models = list(models)
    if len(models) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(models)}")
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; expected one of {METHODS}")
    if align not in ("weights", "activations", None, "none"):
        raise InputError(f"align must be 'weights', 'activations' or None, got {align!r}")
    align = None if align == "none" else align
    if (method != "average" or align == "activations") and data is None:
        raise InputError(f"method={method!r} with align={align!r} needs data (an iterable of batches)")
    data = list(data) if data is not None else None
    w = np.ones(len(models)) if weights is None else np.asarray(weights, float)
    if w.shape != (len(models),) or not np.isfinite(w).all() or w.sum() <= 0:
        raise InputError(f"weights must be {len(models)} finite numbers with a positive sum, got {weights!r}")
    w = w / w.sum()
    for i, m in enumerate(models):
        _check_finite(m, f"model {i}")
    if inputs is None and data is not None:
        inputs = data[0]
    from .. import analyze
    A = models[anchor]
    ra = analyze(A, inputs)
    states, fishers, grams, alignments = [], [], [], []
    anchor_params = {k: p for k, p in A.named_parameters()}
    for i, m in enumerate(models):
        if i == anchor or align is None:
            if i != anchor:
                for k, p in m.named_parameters():
                    if k in anchor_params and tuple(p.shape) != tuple(anchor_params[k].shape):
                        raise InputError(f"model {i} parameter {k!r} has shape {tuple(p.shape)}, the "
                                         f"anchor's is {tuple(anchor_params[k].shape)}: models of "
                                         "different widths need align='weights' or 'activations'")
            st = {k: p.detach().double() for k, p in m.named_parameters()}
            al, rep = None, ra if i == anchor else analyze(m, inputs)
        else:
            al = _align(A, m, inputs, data=data if align == "activations" else None, solver=solver,
                        inner=inner, report_a=ra)
            rep = al.report_b
            st = {k: v.double() for k, v in al.state(m).items()}
            for k, p in m.named_parameters():
                st.setdefault(k, p.detach().double())
        alignments.append(al)
        states.append(st)
        if method == "fisher":
            f = _fisher(m, rep, data)
            if al is not None:
                f = _transform_stat(al, f, square=True)
            fishers.append(f)
        if method == "regmean":
            g, lin = _grams(rep, data)
            if al is not None:
                g = _transform_grams(al, g, lin)
            grams.append(g)
    merged = {}
    for k in states[0]:
        vals = [s[k] for s in states]
        if method == "fisher":
            fs = [f[k] + 1e-12 for f in fishers]
            merged[k] = sum(wi * fi * v for wi, fi, v in zip(w, fs, vals)) / sum(wi * fi for wi, fi in zip(w, fs))
        else:
            merged[k] = sum(wi * v for wi, v in zip(w, vals))
    if method == "regmean":
        _regmean(merged, states, grams, w, ra, regmean_alpha)
    out = copy.deepcopy(A)
    with torch.no_grad():
        for k, v in merged.items():
            out.get_parameter(k).copy_(v.to(anchor_params[k].dtype))
    return (out, alignments) if return_alignments else out


def _transform_stat(al, stat, square):
    an = al.report_b._analysis
    out = dict(stat)
    for name, node in an.param_nodes.items():
        if name not in stat:
            continue
        val = stat[name]
        for d, a in enumerate(an.node_axes[node]):
            M = axis_matrix(an, a, al.elements)
            if M is not None:
                val = apply_along(val, d, M * M if square and M.dim() > 1 else M)
        out[name] = val
    return out


def _transform_grams(al, grams, lin):
    an = al.report_b._analysis
    out = {}
    for wname, x, _ in lin:
        if wname not in grams:
            continue
        M = axis_matrix(an, an.node_axes[x][-1], al.elements)
        G = grams[wname]
        if M is None:
            out[wname] = G
        elif M.dim() == 1:  # a permutation's index vector
            out[wname] = G[M][:, M]
        else:
            out[wname] = M @ G @ M.T
    return out


def _regmean(merged, states, grams, w, ra, alpha):
    """RegMean: W* = (Σ W_i G_i)(Σ G_i)^{-1} per linear layer, G_i regularised towards diag."""
    lin = _linear_inputs(ra._analysis)
    for wname, _, layout in lin:
        if not all(wname in g for g in grams):
            continue
        Gs = []
        for g in grams:
            G = g[wname]
            Gs.append(alpha * G + (1 - alpha) * torch.diag(torch.diag(G)))
        Ws = [s[wname] if layout == "out_in" else s[wname].T for s in states]
        num = sum(wi * W @ G for wi, W, G in zip(w, Ws, Gs))
        den = sum(wi * G for wi, G in zip(w, Gs))
        Wm = torch.linalg.solve(den.T + 1e-8 * torch.eye(den.shape[0], dtype=den.dtype), num.T).T
        merged[wname] = Wm if layout == "out_in" else Wm.T


def interpolate(a, b, lambdas=None, loss_fn=None):
    """Losses along ``λθ_A + (1−λ)θ_B``; returns ``[(λ, loss), ...]`` (21 points by default)."""
    if loss_fn is None:
        raise InputError("interpolate needs loss_fn(model) -> float")
    lambdas = np.linspace(0, 1, 21) if lambdas is None else lambdas
    pa = dict(a.named_parameters())
    pb = dict(b.named_parameters())
    for k in pa:
        if k not in pb or pa[k].shape != pb[k].shape:
            raise InputError(f"models differ at parameter {k!r}; interpolate needs equal shapes")
    m = copy.deepcopy(a)
    curve = []
    for lam in lambdas:
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.copy_(lam * pa[k] + (1 - lam) * pb[k])
        curve.append((float(lam), float(loss_fn(m))))
    return curve


def loss_barrier(curve) -> float:
    """``max_λ L(λ) − ½(L(θ_A) + L(θ_B))`` (seed 002), with θ_A at λ=1 and θ_B at λ=0."""
    curve = sorted(curve)
    if len(curve) < 2:
        raise InputError("loss_barrier needs at least the two end points")
    lo, hi = curve[0][1], curve[-1][1]
    return max(l for _, l in curve) - 0.5 * (lo + hi)

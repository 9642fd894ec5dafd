"""Circuit-space merging (Theus et al. 2025): interpolate each attention head's two bilinear
forms, ``QKᵀ`` and ``OV``, instead of its factors.

Theus et al. rewrite every head as ``(d+1)``-wide circuit matrices before interpolating. The same
function needs only a head N times as wide (N models, mixing weights ``w_i``): on the
query/key side ``Q = [√w_1·Q_1; …; √w_N·Q_N]`` and ``K = [√w_1·K_1; …]`` (biases included), so
``q·k = Σ w_i q_i·k_i``; on the value/output side ``V = [√w_i·V_i]`` and ``O = [√w_i·O_i]``, so
``O·V = Σ w_i O_i V_i``. The softmax scale of the wider head is folded into the query side
(``√N``). Every other weight is the weighted average. The merged model stays in the parents'
architecture family wherever its config can state a head size (an explicit ``head_dim``);
RoPE pairs keep their own frequencies through per-pair factors (``longrope``-type rope
parameters, attention factor 1).

The heads are found from the report (:meth:`~symgraph.report.SymmetryReport.attention_groups`),
never from module names.
"""
from __future__ import annotations

import copy
import math

import torch

from ..errors import InputError

__all__ = ["circuit_merge", "circuit_state", "CircuitPlan", "plan"]


class CircuitPlan:
    """Which slots of which parameters widen, and how (from one model's report).

    ``slots``: ``{param: [(dim, head size, rope half or None, scale on the query side)]}``."""

    def __init__(self, slots: dict, head_dim: int, rope: bool):
        self.slots, self.head_dim, self.rope = slots, head_dim, rope


def plan(report) -> CircuitPlan:
    """The widening of every attention head of ``report``'s model, refused (one line) where
    the heads are not laid out ``[heads, head size]`` on a projection."""
    by_gid = {g.id: g for g in report.groups}
    sites = report.attention_groups()
    if not sites:
        raise InputError(f"{report.model_name} has no attention op (scaled_dot_product_attention) whose "
                         "heads the analysis found; circuit-space merging needs attention heads")
    slots, sizes, rope = {}, set(), False
    for s in sites:
        for role in ("qk", "vo"):
            g = by_gid.get(s[role])
            if g is None or not g.outer:  # not fibred over a head class
                raise InputError(f"attention op {s['node']}: its {role.upper()} head size is not a per-head "
                                 "class of the report; expected heads the analysis resolves (GL or RoPE per head)")
            half = None
            if g.kind == "rope":
                rope, half = True, _rope_half(g)
            for param, dim in g.params:
                axis = report.param_axes(param)[dim]
                st = report.axis_structure(axis)
                if st is None or st[0] != "prod" or st[1][-1] != g.dim:
                    raise InputError(f"{param} dim {dim} is laid out as {st}; circuit-space merging expects "
                                     f"[heads, head size {g.dim}] on every projection")
                qside = role == "qk" and g.variance[g.params.index((param, dim))] == "co"
                slots.setdefault(param, []).append((dim, g.dim, half, qside))
            sizes.add(g.dim)
    if len(sizes) != 1:
        raise InputError(f"attention head sizes differ across layers ({sorted(sizes)}); expected one head size")
    return CircuitPlan(slots, sizes.pop(), rope)


def _rope_half(g) -> int:
    pairs = [tuple(p) for p in (g.pairs or ())]
    half = g.dim // 2
    if pairs != [(i, i + half) for i in range(half)]:
        raise InputError(f"group {g.id}: RoPE pairs {pairs[:3]}... are not (i, i + d/2); the widened head "
                         "keeps pairs only in the rotate-half layout")
    return half


def _widen(tensors, dim, d, half, scales):
    """Concatenate per-head blocks of ``tensors`` (one per model) along ``dim``: each head's
    ``N·d`` coordinates are the models' ``d`` in turn — or, with RoPE, the models' first
    halves then their second halves, so pair ``(j, j + N·d/2)`` is a pair of one model."""
    parts = []
    for t, s in zip(tensors, scales):
        t = t.movedim(dim, -1)
        parts.append(s * t.reshape(*t.shape[:-1], -1, d))
    if half is None:
        out = torch.cat(parts, dim=-1)
    else:
        out = torch.cat([p[..., :half] for p in parts] + [p[..., half:] for p in parts], dim=-1)
    out = out.reshape(*out.shape[:-2], -1)
    return out.movedim(-1, dim)


def circuit_state(states, weights, cplan: CircuitPlan) -> dict:
    """The merged ``{name: tensor}``: widened heads for the planned slots, the weighted average
    elsewhere (``states``: the aligned models' tensors, one dict per model)."""
    n = len(states)
    out = {}
    for name in states[0]:
        ts = [s[name] for s in states]
        if name not in cplan.slots:
            out[name] = sum(w * t for w, t in zip(weights, ts))
            continue
        (dim, d, half, qside), *more = cplan.slots[name]
        if more:
            raise InputError(f"{name} carries heads on {len(more) + 1} axes; expected one")
        scales = [math.sqrt(w) * (math.sqrt(n) if qside else 1.0) for w in weights]
        out[name] = _widen(ts, dim, d, half, scales)
    return out


def _check_config(model, n):
    cfg = getattr(model, "config", None)
    if cfg is None or "head_dim" not in cfg.to_dict():
        name = type(cfg).__name__ if cfg is not None else type(model).__name__
        raise InputError(f"{name} has no head_dim field (its head size is derived from the width), so a "
                         f"circuit-space model with {n}x wider heads cannot be built or saved; expected a "
                         "config with head_dim (LLaMA, Qwen2, Mistral, Gemma...)")


def _config(model, cplan: CircuitPlan, n: int):
    """The merged model's config: head size ``n·d`` (refused where the config cannot say it),
    RoPE pairs at their own frequencies."""
    cfg = copy.deepcopy(model.config)
    d, new = cplan.head_dim, cplan.head_dim * n
    if cfg.head_dim != d:
        raise InputError(f"config head_dim {cfg.head_dim} but the report's heads are {d} wide")
    if cplan.rope:
        rp = dict(cfg.rope_parameters or {})
        inv = _inv_freq(model, cfg, d)
        theta = float(rp.get("rope_theta", 10000.0))
        target = inv.repeat(n).double()  # pair j of the wide head: pair j mod d/2 of a model
        j = torch.arange(0, new, 2, dtype=torch.float64) / new
        factors = (1.0 / (target * theta ** j)).tolist()
        cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": theta, "short_factor": factors,
                               "long_factor": factors, "factor": 1.0, "attention_factor": 1.0,
                               "original_max_position_embeddings": cfg.max_position_embeddings}
    cfg.head_dim = new
    return cfg


def _inv_freq(model, cfg, d):
    """The parents' per-pair RoPE frequencies (``d/2``), from transformers' own rope setup."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rp = cfg.rope_parameters or {}
    kind = rp.get("rope_type", "default")
    if kind == "default":
        theta = float(rp.get("rope_theta", 10000.0))
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise InputError("partial rotary heads are not supported by circuit-space export")
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    if abs(float(factor) - 1.0) > 1e-12:
        raise InputError(f"rope_type {kind!r} scales attention by {factor}; circuit-space export keeps only "
                         "rope types with attention factor 1")
    return inv.double()


def circuit_merge(models, weights, report):
    """Circuit-space merge of ``models`` (aligned, one architecture) with mixing ``weights``
    into a new model whose heads are ``len(models)`` times as wide; ``report`` is the
    anchor's. Its ``config`` says the new head size; parents are left untouched."""
    _check_config(models[0], len(models))
    cplan = plan(report)
    n = len(models)
    cfg = _config(models[0], cplan, n)
    dtype = next(models[0].parameters()).dtype
    states = [{k: v.detach().to(torch.promote_types(v.dtype, torch.float32)) for k, v in m.state_dict().items()}
              for m in models]
    merged = circuit_state(states, [float(w) for w in weights], cplan)
    with torch.device("meta"):
        new = type(models[0])(cfg)
    new = new.to_empty(device=next(models[0].parameters()).device)
    want = new.state_dict()
    missing, extra = sorted(set(want) - set(merged)), sorted(set(merged) - set(want))
    if missing or extra:
        raise InputError(f"the circuit-space model and the parents disagree on tensors (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); expected the parents' tensors, heads widened")
    wrong = [k for k, v in merged.items() if tuple(want[k].shape) != tuple(v.shape)]
    if wrong:
        raise InputError(f"{type(cfg).__name__} with head_dim {cfg.head_dim} builds {wrong[0]} as "
                         f"{tuple(want[wrong[0]].shape)}, not {tuple(merged[wrong[0]].shape)}; the config "
                         "cannot express the wider heads")
    new.load_state_dict({k: v.to(dtype) for k, v in merged.items()}, strict=True, assign=True)
    _recompute_buffers(new, cfg)
    return new.eval()


def _recompute_buffers(model, cfg):
    """Non-persistent buffers (RoPE frequencies) hold no saved value: rebuild the modules that
    own them from the new config, on the model's device."""
    dev = next(model.parameters()).device
    for name, mod in list(model.named_modules()):
        if not getattr(mod, "_non_persistent_buffers_set", None) or any(True for _ in mod.parameters(recurse=False)):
            continue
        with torch.device(dev):
            fresh = type(mod)(config=cfg)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, fresh)

"""``resize()``: change the width of permutation classes on purpose.

Widening (Net2Net, any multiplicities) copies each unit k ≥ 1 times: its incoming (covariant)
slices are copied, its outgoing (contravariant) slices split among the copies (evenly, or by
random shares with ``split="random"``), so the function is kept exactly wherever the graph
only maps the class elementwise (MLP units, heads). Shrinking (compression, as in OT fusion
and ZipIt) clusters the units by their incoming weights (weighted k-means, the weights being
the transport masses of :mod:`symgraph.alignment.masses`): each cluster becomes one unit whose
incoming weights are the mass-weighted mean of its members' and whose outgoing weights are
their sum. The result is a transport map like any other (:class:`~symgraph.core.elements.Map`)
moved through the one walk of :mod:`symgraph.transform.apply`; its error is measured, not assumed.

The new model: for a Hugging Face model, the config fields that give the new shapes are found
by building candidate configs on the meta device and comparing every parameter's shape (no
table of field names; a width the config cannot express, such as one layer's MLP when all
layers share ``intermediate_size``, is refused). Other modules are copied with their
parameters replaced, and the shape attributes of ``torch.nn``'s own layers updated.
"""
from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..core.modes import set_mode
from ..alignment.masses import slices, unit_masses
from ..report.api import analyze
from ..transform.apply import move, stored_tensors
from ..core.devices import meta_model
from ..core.elements import Map
from ..core.finite import require_finite
from ..core.schema import SEED
from ..errors import InputError
from ..core.groups import PERMUTATION_FAMILY
from ..passes.trace import eval_mode, flatten_outputs, output_deviation, split_inputs

__all__ = ["ResizeResult", "resize", "resizable", "same_role"]

WIDEN_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class ResizeResult:
    """What :func:`resize` returns: the new ``model``; ``widths`` ``{group id: (old, new)}``;
    ``error``: the relative output deviation from the original on the inputs (≈ 0 for
    widening, the price of compression for shrinking); ``config``: ``{field: (old, new)}``
    changed in a Hugging Face config; ``maps``: the transport map per class (new × old)."""
    model: torch.nn.Module
    widths: dict
    error: float
    config: dict = field(default_factory=dict)
    maps: dict = field(default_factory=dict, repr=False)


def resizable(report, group) -> str | None:
    """None when ``group`` can be resized, else why not."""
    if group.kind not in PERMUTATION_FAMILY:
        return f"its symmetry is {group.kind}: only permutation classes can be resized"
    if group.outer:
        return "it is fibred over a head class (one element per head): resize the head class"
    return None


def resize(model, widths, inputs=None, *, split: str = "even", seed: int = 0,
           report=None, check: bool = True) -> ResizeResult:
    """A copy of ``model`` with the permutation classes in ``widths`` resized.

    widths : ``{group id or Group: new width}`` (group ids as in ``symgraph.analyze(model)``),
        or a function ``group -> new width | None``.
    split : how a widened unit's outgoing weights are shared by its copies: "even" (1/k each,
        Net2Net) or "random" (random positive shares summing to 1).
    check : refuse a widening that does not keep the function (the graph reduces over the
        class, e.g. a norm over the residual stream), naming the class.
    """
    if split not in ("even", "random"):
        raise InputError(f"split={split!r}; expected 'even' or 'random'")
    SEED.check(seed, "seed=")
    report = report or analyze(model, inputs)
    targets = _targets(report, widths)
    _check_memory(report, model, targets)
    tensors = stored_tensors(report, model, check=True)
    gen = torch.Generator().manual_seed(seed)
    maps = {}
    for g, m in targets:
        maps[g.id] = (_widen(g.size, m, split, gen) if m >= g.size
                      else _shrink(report, tensors, g, m, gen))
    moved = move(report, maps, tensors)
    state = {k: moved[k].to(t.dtype) if k in moved else t for k, t in tensors.items()}
    new, cfg = _build(model, state, report)
    args, kwargs = report.inputs if inputs is None else split_inputs(model, inputs)
    err = _deviation(model, new, args, kwargs)
    tol = WIDEN_TOL.get(next(iter(tensors.values())).dtype, 1e-4)
    widened = all(m >= g.size for g, m in targets)
    if check and widened and not err <= tol:
        raise InputError(f"widening class(es) {sorted(g.id for g, _ in targets)} changes the function "
                         f"(relative output deviation {err:.3g}, expected at most {tol:g}): the graph "
                         "reduces over the class (a norm or sum); only classes mapped elementwise "
                         "can be widened exactly")
    return ResizeResult(new, {g.id: (g.size, m) for g, m in targets}, err, cfg, maps)


def available_memory() -> int:
    """Bytes of memory available to a new allocation (``MemAvailable``; physical memory where
    the kernel does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_memory(report, model, targets):
    """Refuse widths whose model does not fit: the resized copy, the moved tensors and the
    parent (about three copies of the new parameters) must fit in the available memory."""
    grow = {}
    for g, m in targets:
        for p, d in g.params:
            grow.setdefault(p, {})[d] = m / g.size
    total = 0
    for name, t in model.state_dict().items():
        total += t.numel() * t.element_size() * math.prod(grow.get(name, {}).values())
    need, have = 3 * total, available_memory()
    if need > have:
        sizes = ", ".join(f"class {g.id}: {g.size} -> {m}" for g, m in targets)
        raise InputError(f"resizing ({sizes}) gives a model of {total / 2**30:.3g} GiB, which needs about "
                         f"{need / 2**30:.3g} GiB to build, and {have / 2**30:.3g} GiB is available; expected "
                         "widths whose model fits in memory")


def _role(report, g):
    """What a class does, whatever layer it is in: kind, size and its slots' parameter names
    with layer numbers blanked."""
    names = tuple(sorted((re.sub(r"\.\d+\.", ".#.", n), d, v)
                         for (n, d), v in zip(g.params, g.variance)))
    return g.kind, g.size, tuple(g.outer) and len(g.outer), names


def same_role(report, widths: dict) -> dict:
    """``widths`` extended to every class with the same role (:func:`_role`) as one it names:
    the MLP of every layer from the MLP of one."""
    by_id = {g.id: g for g in report.groups}
    roles = {_role(report, by_id[gid]): m for gid, m in widths.items() if gid in by_id}
    out = dict(widths)
    for g in report.groups:
        m = roles.get(_role(report, g))
        if m is not None:
            out.setdefault(g.id, m)
    return out


def _targets(report, widths) -> list:
    by_id = {g.id: g for g in report.groups}
    if callable(widths):
        widths = {g.id: widths(g) for g in report.groups}
        widths = {k: v for k, v in widths.items() if v is not None}
    if not isinstance(widths, dict) or not widths:
        raise InputError("widths must be a non-empty {group id: new width} dict or a function "
                         "group -> width")
    out = {}
    for key, m in widths.items():
        gid = getattr(key, "id", key)
        if gid not in by_id:
            raise InputError(f"no class {key!r} in {report.model_name}'s report; expected one of "
                             f"the group ids 0..{len(report.groups) - 1} (see symgraph analyze)")
        g = by_id[gid]
        why = resizable(report, g)
        if why:
            raise InputError(f"class {gid} ({g.module or 'model'}, {g.kind}) cannot be resized: {why}")
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise InputError(f"width {m!r} for class {gid}; expected a positive integer")
        if m == g.size:
            raise InputError(f"class {gid} ({g.module or 'model'}) is already {m} wide; expected a new width")
        out[gid] = (g, m)
    return list(out.values())


def _widen(n: int, m: int, split: str, gen) -> Map:
    """Each of ``n`` units copied at least once, ``m - n`` extra copies spread over random
    units (at most one more than any other unit has); outgoing weights split."""
    k = torch.full((n,), m // n, dtype=torch.long)
    k[torch.randperm(n, generator=gen)[: m % n]] += 1
    src = torch.repeat_interleave(torch.arange(n), k)
    if split == "even":
        share = 1.0 / k[src].double()
    else:
        share = torch.rand(m, generator=gen, dtype=torch.float64) + 0.5
        share = share / torch.zeros(n, dtype=torch.float64).index_add_(0, src, share)[src]
    rows = torch.arange(m)
    co = torch.zeros(m, n, dtype=torch.float64)
    co[rows, src] = 1.0
    contra = torch.zeros(m, n, dtype=torch.float64)
    contra[rows, src] = share
    return Map(co, contra)


def _shrink(report, tensors, g, m: int, gen) -> Map:
    """Weighted k-means (k-means++ start) of the units' incoming slices into ``m`` clusters;
    the plan ``T [m, n]`` holds each unit's mass in its cluster's row."""
    feats = list(slices(report, tensors, g, "co"))
    if not feats:
        raise InputError(f"class {g.id} has no incoming weights to cluster its units by")
    X = torch.cat(feats, -1)
    w = unit_masses(report, tensors, g)
    w = torch.ones(g.size, dtype=torch.float64) if w is None else w.to(torch.float64).cpu()
    w = w.clamp_min(1e-12 * float(w.max().clamp_min(1e-300)))
    X = X.cpu()
    labels = _kmeans(X, w, m, gen)
    T = torch.zeros(m, g.size, dtype=torch.float64)
    T[labels, torch.arange(g.size)] = w
    return Map.from_plan(T)


def _kmeans(X, w, k, gen, iters: int = 100):
    first = int(torch.multinomial(w / w.sum(), 1, generator=gen))
    picked = [X[first]]
    d2 = ((X - picked[0]) ** 2).sum(-1)
    for _ in range(1, k):
        p = w * d2
        nxt = int(torch.multinomial(p / p.sum(), 1, generator=gen)) if p.sum() > 0 else int(d2.argmax())
        picked.append(X[nxt])
        d2 = torch.minimum(d2, ((X - X[nxt]) ** 2).sum(-1))
    C = torch.stack(picked)
    labels = None
    for _ in range(iters):
        new = torch.cdist(X, C).argmin(1)
        counts = torch.zeros(k, dtype=torch.float64).index_add_(0, new, w)
        empty = (counts == 0).nonzero().flatten()
        for c in empty.tolist():  # an empty cluster takes the unit farthest from its centre
            far = int(((X - C[new]) ** 2).sum(-1).argmax())
            new[far] = c
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, labels, w)
        C = torch.zeros_like(C).index_add_(0, labels, X * w[:, None]) / mass[:, None]
    return labels


def _deviation(a, b, args, kwargs) -> float:
    """The resized model's relative output deviation from the original's, refused in one line
    when either computes NaN/inf on the inputs (a deviation is measured, never assumed)."""
    with torch.no_grad(), eval_mode(a), eval_mode(b):
        before, after = flatten_outputs(a(*args, **kwargs)), flatten_outputs(b(*args, **kwargs))
    require_finite("resize", "the original model's outputs on the check inputs", *before)
    require_finite("resize", "the resized model's outputs on the check inputs", *after)
    return output_deviation(before, after)


# --- the new model ------------------------------------------------------------------------


def _build(model, state: dict, report):
    """``(new model, config changes)`` holding ``state`` (every tensor the report names)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for keep, others in report.aliases.items():
        for o in others:
            shapes[o] = shapes[keep]
    cfg_changes = {}
    if hasattr(model, "config") and hasattr(model, "save_pretrained"):
        cfg, cfg_changes = _config_for(model, shapes)
        p0 = next(model.parameters())
        with torch.device(p0.device):  # built for real: non-persistent buffers (RoPE) are set
            new = type(model)(cfg).to(p0.dtype)
        own = model.state_dict()
        full = {k: state.get(k, own[k]) for k in new.state_dict()}
        missing = [k for k in full if k not in state and k not in own]
        if missing:
            raise InputError(f"the resized model has tensors the original lacks: {missing[:3]}")
        new.load_state_dict(full, strict=True, assign=False)
        if hasattr(new, "tie_weights"):
            new.tie_weights()
    else:
        new = copy.deepcopy(model)
        _replace(new, state)
    set_mode(new, model.training)
    return new, cfg_changes


def _replace(new, state):
    with torch.no_grad():
        for name, val in state.items():
            mod_name, _, attr = name.rpartition(".")
            mod = new.get_submodule(mod_name)
            old = getattr(mod, attr)
            if isinstance(old, torch.nn.Parameter):
                setattr(mod, attr, torch.nn.Parameter(val.to(old), requires_grad=old.requires_grad))
            else:
                setattr(mod, attr, val.to(old))
    for mod in new.modules():  # torch.nn's own layers record their sizes
        _sync_sizes(mod)


def _sync_sizes(mod):
    w = getattr(mod, "weight", None)
    if isinstance(mod, torch.nn.Linear):
        mod.out_features, mod.in_features = w.shape
    elif isinstance(mod, torch.nn.modules.conv._ConvNd):
        mod.out_channels, mod.in_channels = w.shape[0], w.shape[1] * mod.groups
    elif isinstance(mod, torch.nn.modules.batchnorm._NormBase):
        mod.num_features = (w if w is not None else mod.running_mean).shape[0]
    elif isinstance(mod, torch.nn.LayerNorm) and w is not None:
        mod.normalized_shape = tuple(w.shape[-len(mod.normalized_shape):])
    elif isinstance(mod, torch.nn.Embedding):
        mod.num_embeddings, mod.embedding_dim = w.shape


def _config_for(model, shapes: dict):
    """The Hugging Face config whose model has exactly ``shapes``: single-field candidates
    (integer fields scaled by a width ratio, unset ones set to a new width) that change only
    tensors that must change, combined and checked on the meta device."""
    cfg0 = model.config
    base = _meta_shapes(model, cfg0)
    want = {k: s for k, s in shapes.items() if k in base}
    diff = {k for k in want if want[k] != base[k]}
    ratios, news = set(), set()
    for k in diff:
        for a, b in zip(base[k], want[k]):
            if a != b:
                ratios.add((b, a))
                news.add(b)
    cands: dict = {}
    for name, v in cfg0.to_dict().items():
        if isinstance(v, bool) or name.endswith("_token_id") or name.startswith("_"):
            continue
        vals = ({v * b // a for b, a in ratios if (v * b) % a == 0 and v * b // a != v}
                if isinstance(v, int) and v > 0 else set(news) if v is None else set())
        for val in sorted(vals):
            cfg = _with(cfg0, {name: val})
            got = _meta_shapes(model, cfg) if cfg is not None else {}
            changed = {k for k in base if got.get(k) != base[k]}
            if changed and changed <= diff and all(got[k] == want[k] or k in diff for k in changed):
                cands.setdefault(name, []).append(val)
    for combo in _combos(cands):
        cfg = _with(cfg0, combo)
        got = _meta_shapes(model, cfg) if cfg is not None else {}
        if all(got.get(k) == want[k] for k in want):
            return cfg, {k: (getattr(cfg0, k), v) for k, v in combo.items()}
    raise InputError(f"no change of {type(cfg0).__name__}'s fields gives the resized shapes "
                     f"(e.g. of {sorted(diff)[:2]}): the config cannot express these widths (it "
                     "may derive one from others, e.g. head size = hidden size / heads, or hold "
                     "one width for all layers: then resize every such class to the same width)")


def _combos(cands, limit: int = 64):
    """Candidate field assignments, all fields first (one value each), then single fields."""
    names = sorted(cands)
    out: list = []
    seen: set = set()

    def rec(i, cur):
        if len(out) >= limit:
            return
        if i == len(names):
            key = tuple(sorted(cur.items()))
            if cur and key not in seen:
                seen.add(key)
                out.append(dict(cur))
            return
        for v in cands[names[i]]:
            rec(i + 1, cur | {names[i]: v})
        rec(i + 1, cur)
    rec(0, {})
    out.sort(key=lambda c: -len(c))
    return out


def _with(cfg, changes: dict):
    """A copy of ``cfg`` with ``changes``, or None where the config refuses a value."""
    new = copy.deepcopy(cfg)
    try:
        for k, v in changes.items():
            setattr(new, k, v)
    except Exception:  # a typed config field (strict dataclass validation)
        return None
    return new


def _meta_shapes(model, cfg) -> dict:
    try:
        m = meta_model(type(model), cfg)
    except Exception:  # an inconsistent candidate config (e.g. heads not dividing the width)
        return {}
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}

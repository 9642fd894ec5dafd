"""Merging methods compared by the benchmark suite (:data:`METHODS`).

Every method takes a :class:`Pair` (anchor ``a``, second model ``b``, their symmetry reports,
alignment data) and returns an :class:`Outcome`: ``b`` carried into ``a``'s basis
(``b_aligned``; the runner walks the line ``λθ_A + (1−λ)θ_B'``) or one merged model
(``merged``: Fisher, RegMean, REPAIR, which are not interpolations).

The seed methods are :func:`symgraph.align` restricted to the symmetry classes each seed aligns,
with its solver, inner solve and similarity source; :data:`DEVIATIONS` says what differs from
each paper. Roles are read from the report's structure (:func:`roles`): heads are the ids in
some group's ``outer``, head-inner classes the groups fibred over one; the residual stream is the
unfibred, non-head, non-GL class with the most parameter slots, the MLP every other unfibred,
non-head permutation class; the attention output projection is the head class's parameter of
minority slot variance (Q, K, V carry the heads covariantly, O contravariantly), and the
continuous head-inner class acting on it is VO, the others QK.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import symgraph
from symgraph.alignment.refine import choose_start, refine
from symgraph.core.groups import PERMUTATION_FAMILY

from . import evaluate

#: Entropic regularisation of Imfeld et al. 2024's Sinkhorn maps (its ViT config with activations).
SINKHORN_REG = 0.08
#: symgraph_refine: Adam steps, step size and training batches (with labels) of its loss.
REFINE_STEPS, REFINE_LR, REFINE_BATCHES = 200, 1e-3, 32


@dataclass
class Pair:
    """Two trained models of one architecture, their reports and ``data``, a list of alignment
    batches (positional-input tuples, training split)."""
    arch: str
    a: torch.nn.Module
    b: torch.nn.Module
    data: list
    report_a: object
    report_b: object
    _perm: tuple | None = field(default=None, repr=False)

    def perm_reports(self) -> tuple:
        """Reports without norm folding: the residual stream a permutation class, as in the seeds."""
        if self._perm is None:
            self._perm = (self.report_a, self.report_b)
            if self.report_a.folds or self.report_b.folds:
                x = self.data[0] if self.data else None
                self._perm = tuple(symgraph.analyze(m, x, fold_norms=False) for m in (self.a, self.b))
        return self._perm


@dataclass
class Outcome:
    """A method's ``b_aligned`` or ``merged`` model; ``seconds``: its wall time (alignment and
    merge, no evaluation); ``align_seconds``: inside ``symgraph.align`` (its own clock)."""
    b_aligned: torch.nn.Module | None = None
    merged: torch.nn.Module | None = None
    alignment: object = None
    seconds: float = 0.0
    align_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def roles(report) -> SimpleNamespace:
    """Group ids of ``report`` by structural role (no module or parameter names): ``residual``,
    ``mlp``, ``heads``, ``vo_inner``, ``qk_inner``, ``continuous_inner`` (both) and ``out_params``,
    the attention output projections' parameter names."""
    groups = report.groups
    heads = frozenset(o for g in groups for o in g.outer)
    free = [g for g in groups if not g.outer and g.id not in heads]
    stream = [g for g in free if g.kind != "gl"]
    residual = frozenset([max(stream, key=lambda g: (len(g.params), -g.id)).id]) if stream else frozenset()
    mlp = frozenset(g.id for g in free if g.kind in PERMUTATION_FAMILY and g.id not in residual)
    out_params = set()
    for g in groups:
        if g.id in heads:
            by_var: dict[str, set] = {}
            for (name, _), var in zip(g.params, g.variance):
                by_var.setdefault(var, set()).add(name)
            if len(by_var) == 2:
                out_params |= min(by_var.values(), key=len)
    continuous = [g for g in groups if g.outer and g.kind not in PERMUTATION_FAMILY]
    vo = frozenset(g.id for g in continuous if any(n in out_params for n, _ in g.params))
    qk = frozenset(g.id for g in continuous if g.id not in vo)
    return SimpleNamespace(residual=residual, mlp=mlp, heads=heads, vo_inner=vo, qk_inner=qk, continuous_inner=vo | qk,
                           out_params=frozenset(out_params))


def _aligned(p: Pair, al, t0: float, **extra) -> Outcome:
    return Outcome(b_aligned=al.apply(p.b), alignment=al, seconds=time.perf_counter() - t0,
                   align_seconds=al.seconds.get("total", 0.0), extra=extra)


def _perm_align(p: Pair, **kw):
    """``symgraph.align`` on the reports without norm folding (the seeds' permutation stream)."""
    ra, rb = p.perm_reports()
    return symgraph.align(p.a, p.b, report_a=ra, report_b=rb, fold_norms=False, **kw)


def _symgraph(activations: bool = False, perm: bool = False, **kw):
    """The method ``symgraph.align(**kw)``, timed: from activations on the pair's data or from
    weights; ``perm``: without norm folding (the residual stream a permutation)."""
    def method(p: Pair) -> Outcome:
        t0 = time.perf_counter()
        opts = dict(kw, data=p.data) if activations else kw
        if perm:
            return _aligned(p, _perm_align(p, **opts), t0)
        return _aligned(p, symgraph.align(p.a, p.b, report_a=p.report_a, report_b=p.report_b, **opts), t0)
    return method


def _merge(method: str, align, repair: bool = False):
    """The merged-model method ``symgraph.merge([a, b], data, method, align, repair)``, timed."""
    def run(p: Pair) -> Outcome:
        t0 = time.perf_counter()
        res = symgraph.merge([p.a, p.b], data=p.data, method=method, align=align, repair=repair)
        al = res.alignments[1]
        return Outcome(merged=res.model, alignment=al, seconds=time.perf_counter() - t0,
                       align_seconds=al.seconds.get("total", 0.0) if al is not None else 0.0,
                       extra={"repair": res.repair.to_dict()} if res.repair is not None else {})
    return run


def vanilla(p: Pair) -> Outcome:
    """Plain weight averaging / interpolation, no alignment (every seed's baseline)."""
    return Outcome(b_aligned=p.b)


def verma2024(p: Pair) -> Outcome:
    """Verma & Elbayad 2024: permutations from activation correlations (training batches) of the
    MLP units, the residual stream (one for the whole stream, the paper's "All") and the heads by
    nested matching (outer Hungarian over head pairs whose cost is the inner Hungarian on the
    head-dim correlation of the attention output); the head-dim permutation is applied to Q and
    K as well (the paper's shared ``P_MHA``)."""
    t0 = time.perf_counter()
    ra = p.perm_reports()[0]
    r, ga = roles(ra), ra.groups
    perm_inner = {g.id for g in ra.groups if g.outer and g.kind in PERMUTATION_FAMILY}
    sel = r.residual | r.mlp | r.heads | r.vo_inner | perm_inner
    al = _perm_align(p, data=p.data, inner="hungarian", groups=lambda g: g.id in sel)
    tied = 0
    for qk in sorted(r.qk_inner):  # each QK-inner class takes the VO-inner element of its heads
        if ga[qk].kind == "rope":
            continue  # only pair rotations are symmetries under RoPE
        vo = next((v for v in r.vo_inner if ga[v].outer == ga[qk].outer and al.elements.get(v) is not None
                   and ga[v].dim == ga[qk].dim), None)
        if vo is not None:
            al.elements[qk] = al.elements[vo].clone()
            tied += 1
    return _aligned(p, al, t0, qk_tied_to_vo=tied)


def zhang2025(p: Pair, rescale: bool = False) -> Outcome:
    """Zhang et al. 2024: data-free matching from weights: MLP units by Hungarian on the weight
    inner products of both MLP matrices (and bias); per attention head an orthogonal Procrustes
    rotation for the QK pair and one for the VO pair, heads paired by index, residual stream not
    aligned. ``rescale``: after each head's rotation R a scalar ``a > 0`` per head and QK / VO
    pair minimising ``‖W_A − a·R W_B‖² + ‖W'_A − R W'_B / a‖²`` (``alignment.scales``)."""
    t0 = time.perf_counter()
    r = roles(p.perm_reports()[0])
    sel = r.mlp | r.continuous_inner
    al = _perm_align(p, inner="procrustes", groups=lambda g: g.id in sel, rescale=rescale)
    return _aligned(p, al, t0, **({"scales": {str(k): v for k, v in al.scales.items()}} if rescale else {}))


def zhang2025_rescale(p: Pair) -> Outcome:
    """:func:`zhang2025` with its per-head scalar rescaling."""
    return zhang2025(p, rescale=True)


def imfeld2024(p: Pair) -> Outcome:
    """Imfeld et al. 2024: OT fusion with soft Sinkhorn transport maps (regularisation
    :data:`SINKHORN_REG`) from activations, for every class, as in the seed's ViT configuration."""
    t0 = time.perf_counter()
    return _aligned(p, _perm_align(p, data=p.data, solver="sinkhorn", reg=SINKHORN_REG, inner="hungarian"), t0)


def symgraph_refine(p: Pair) -> Outcome:
    """Learned matching as ``align(..., refine=N)`` does it: from activation or weight matching,
    whichever has the lower midpoint training loss, the elements optimised so that the model
    interpolated at λ ~ U(0.4, 0.6) has low training loss (:data:`REFINE_STEPS` Adam steps on
    :data:`REFINE_BATCHES` training batches; the benchmark's own loss)."""
    t0 = time.perf_counter()
    kw = dict(report_a=p.report_a, report_b=p.report_b)
    starts = {"activations": symgraph.align(p.a, p.b, data=p.data, **kw), "weights": symgraph.align(p.a, p.b, **kw)}
    batches = evaluate.eval_batches(p.arch, "train", REFINE_BATCHES)
    loss_fn = lambda m, b: evaluate.batch_loss(m, p.arch, b)  # noqa: E731
    name, losses = choose_start(starts, p.a, p.b, batches, loss_fn)
    al = starts[name]
    al.refined = refine(al, p.a, p.b, batches, REFINE_STEPS, lr=REFINE_LR, progress=False, loss_fn=loss_fn)
    al.refined.update(start=name, start_loss=losses)
    return _aligned(p, al, t0, refined=dict(al.refined))


#: name -> (method, description), in table order. Fisher: diagonal Fisher of each model's own
#: predictions on the alignment data; RegMean: per linear layer ``(Σ W_i G_i)(Σ G_i)^{-1}``, input
#: Grams regularised towards their diagonal (α = 0.9); REPAIR: hidden pre-activation statistics
#: set to the parents' interpolation on the alignment data. ``_exact``: every change taken
#: (``until="exact"``, ``tol=0``) with exact products, the reference of the fast defaults;
#: ``_full``: then the full groups fitted (GL per head, RoPE pair scales).
METHODS = {
    "vanilla": (vanilla, "plain averaging"),
    "verma2024": (verma2024, "Verma & Elbayad: activation perms (FFN, heads nested, residual)"),
    "zhang2025": (zhang2025, "Zhang et al.: FFN Hungarian + per-head Procrustes QK/VO, weights"),
    "zhang2025_rescale": (zhang2025_rescale, "Zhang et al. + per-head scalar rescaling"),
    "imfeld2024": (imfeld2024, "Imfeld et al.: OT fusion, soft Sinkhorn maps from activations"),
    "fisher": (_merge("fisher", None), "Fisher merging, no alignment"),
    "fisher_aligned": (_merge("fisher", "weights"), "Fisher merging after symgraph weight matching"),
    "vanilla_repair": (_merge("average", None, repair=True), "plain averaging + REPAIR"),
    "symgraph_repair": (_merge("average", "activations", repair=True),
                        "symgraph activation matching + averaging + REPAIR"),
    "regmean": (_merge("regmean", None), "RegMean, no alignment"),
    "regmean_aligned": (_merge("regmean", "weights"), "RegMean after symgraph weight matching"),
    "symgraph_weights_perm": (_symgraph(perm=True), "symgraph weight matching, residual as a permutation"),
    "symgraph_activations_perm": (_symgraph(True, perm=True),
                                  "symgraph activation matching, residual as a permutation"),
    "symgraph_weights": (_symgraph(), "symgraph, all classes, weight matching"),
    "symgraph_activations": (_symgraph(True), "symgraph, all classes, activation matching"),
    "symgraph_weights_exact": (_symgraph(tol=0.0, similarity="exact", until="exact"),
                               "symgraph weight matching, tol=0, exact products"),
    "symgraph_weights_bf16": (_symgraph(similarity="bf16"), "symgraph weight matching, bf16 products"),
    "symgraph_refine": (symgraph_refine, "symgraph learned matching (from activations or weights)"),
    "symgraph_weights_full": (_symgraph(full_groups=True),
                              "symgraph weight matching + full groups (GL, RoPE scales)"),
    "symgraph_activations_full": (_symgraph(True, full_groups=True), "symgraph activation matching + full groups"),
}

#: Methods that are symgraph's own (the "some symgraph method beats vanilla" check).
SYMGRAPH_METHODS = ("symgraph_weights_perm", "symgraph_activations_perm", "symgraph_weights",
                    "symgraph_weights_exact", "symgraph_weights_bf16",
                    "symgraph_activations", "symgraph_refine", "symgraph_repair", "symgraph_weights_full",
                    "symgraph_activations_full")

#: The published ("seed") methods the suite compares against, named after their papers.
SEED_METHODS = ("verma2024", "zhang2025", "zhang2025_rescale", "imfeld2024")

#: One line per seed method: what differs from the paper.
DEVIATIONS = {
    "verma2024": "head-dim scores are covariances normalised per head pair (not per-feature "
               "correlations); LLaMA Q/K keep their head-dim order (RoPE admits no permutation); "
               "GQA query heads permuted only within their KV group.",
    "zhang2025": "LLaMA QK rotation restricted to RoPE's 2x2 frequency-pair rotations; GQA: one "
               "rotation per KV head; weight similarities use the already-solved classes "
               "(coordinate descent) instead of one pass against unaligned neighbours.",
    "zhang2025_rescale": "as zhang2025; the per-head scalar is fitted once after the rotations "
                       "(closed 1-D fit per head), not jointly with them.",
    "imfeld2024": "one soft map for the whole residual stream instead of per-branch maps mixed by "
               "the 'mean' policy; heads matched by exact OT (hard) with a Hungarian map inside "
               "each head and Q/K sharing it, where the seed ignores heads with separate soft "
               "maps for Q, K, V; cost max(corr)-corr instead of Euclidean distance.",
    "fisher_aligned": "alignment is symgraph's full weight matching, not Zhang et al. 2024's subset.",
    "regmean_aligned": "alignment is symgraph's full weight matching, not Zhang et al. 2024's subset.",
}

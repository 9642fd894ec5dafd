"""Merging methods compared by the benchmark suite, one function per method.

Every method takes a :class:`Pair` (anchor ``a``, second model ``b``, their symmetry reports,
alignment data) and returns an :class:`Outcome`: either ``b`` carried into ``a``'s basis
(``b_aligned``; the runner then walks the 21-point line ``λθ_A + (1−λ)θ_B'``) or a single
merged model (``merged``; Fisher and RegMean, which are not interpolations).

The seed methods are re-expressed with :func:`symgraph.align` by choosing *which* symmetry
classes each seed aligns and *how* (solver, inner solve, similarity source). Group roles are
read from the report's structure, never from module names (:func:`roles`):

* head classes: the ids that appear in some group's ``outer``;
* head-inner classes: groups fibred over a head class (``outer`` non-empty);
* residual stream: the unfibred, non-head class with the most parameter slots (a permutation
  class, or an orthogonal one where norm gains fold: ``report.folds``);
* MLP: every other unfibred, non-head permutation class;
* VO-inner vs QK-inner: the output projection is the parameter of a head class whose slot
  variance is the minority one (Q, K, V carry the heads covariantly, O contravariantly); the
  continuous head-inner class that also acts on that parameter is VO, the others are QK.

Deviations from the seed papers are listed in each function's docstring and repeated in the
suite's ``report.md`` (:data:`DEVIATIONS`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import symgraph
from symgraph.core.groups import PERMUTATION_FAMILY

__all__ = ["Pair", "Outcome", "Roles", "roles", "METHODS", "DEVIATIONS", "SINKHORN_REG",
           "vanilla", "verma2024", "zhang2025", "zhang2025_rescale", "imfeld2024",
           "SEED_METHODS",
           "fisher", "fisher_aligned", "regmean", "regmean_aligned",
           "symgraph_weights_perm", "symgraph_activations_perm", "symgraph_weights",
           "symgraph_activations", "symgraph_refine", "vanilla_repair", "symgraph_repair",
           "symgraph_weights_full", "symgraph_activations_full", "symgraph_weights_exact",
           "symgraph_weights_bf16"]

#: Entropic regularisation of Imfeld et al. 2024's Sinkhorn maps (its ViT config: 0.08 with activations).
SINKHORN_REG = 0.08


@dataclass
class Pair:
    """Two trained models of one architecture and what every method may use.

    ``data`` is a list of alignment batches (positional-input tuples, training split) and
    ``report_a`` / ``report_b`` the models' symmetry reports (computed once per pair).
    """
    arch: str
    a: torch.nn.Module
    b: torch.nn.Module
    data: list
    report_a: object
    report_b: object
    _perm: tuple | None = field(default=None, repr=False)

    def perm_reports(self) -> tuple:
        """Reports without norm folding (``fold_norms=False``): the residual stream is a
        permutation class, as in the seed papers."""
        if self._perm is None:
            if not (self.report_a.folds or self.report_b.folds):
                self._perm = (self.report_a, self.report_b)
            else:
                x = self.data[0] if self.data else None
                self._perm = (symgraph.analyze(self.a, x, fold_norms=False),
                              symgraph.analyze(self.b, x, fold_norms=False))
        return self._perm


@dataclass
class Outcome:
    """What a method produced: ``b_aligned`` (interpolation methods) or ``merged``."""
    b_aligned: torch.nn.Module | None = None
    merged: torch.nn.Module | None = None
    alignment: object = None
    seconds: float = 0.0          # wall time of the method (alignment + merge), no evaluation
    align_seconds: float = 0.0    # time inside symgraph.align (its own clock), if any
    extra: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "interpolation" if self.b_aligned is not None else "merged"


@dataclass(frozen=True)
class Roles:
    """Group ids of a report by structural role (see the module docstring)."""
    residual: frozenset
    mlp: frozenset
    heads: frozenset
    head_inner: frozenset
    vo_inner: frozenset
    qk_inner: frozenset
    out_params: frozenset  # parameter names of the attention output projections

    @property
    def continuous_inner(self) -> frozenset:
        return self.vo_inner | self.qk_inner


def roles(report) -> Roles:
    """Classify ``report.groups`` by structure (no module or parameter names)."""
    groups = report.groups
    heads = frozenset(o for g in groups for o in g.outer)
    head_inner = frozenset(g.id for g in groups if g.outer)
    unfibred = [g for g in groups if not g.outer and g.id not in heads and g.kind in PERMUTATION_FAMILY]
    stream = [g for g in groups if not g.outer and g.id not in heads and g.kind != "gl"]
    residual = frozenset([max(stream, key=lambda g: (len(g.params), -g.id)).id]) if stream else frozenset()
    mlp = frozenset(g.id for g in unfibred if g.id not in residual)
    out_params = set()
    for g in groups:
        if g.id not in heads:
            continue
        by_var: dict[str, set] = {}
        for (name, _), var in zip(g.params, g.variance):
            by_var.setdefault(var, set()).add(name)
        if len(by_var) == 2:
            out_params |= min(by_var.values(), key=len)
    continuous = [g for g in groups if g.outer and g.kind not in PERMUTATION_FAMILY]
    vo = frozenset(g.id for g in continuous if any(n in out_params for n, _ in g.params))
    qk = frozenset(g.id for g in continuous if g.id not in vo)
    return Roles(residual, mlp, heads, head_inner, vo, qk, frozenset(out_params))


def _perm_align(p: Pair, **kw):
    """``symgraph.align`` on the reports without norm folding (the seeds' permutation stream)."""
    ra, rb = p.perm_reports()
    return symgraph.align(p.a, p.b, report_a=ra, report_b=rb, fold_norms=False, **kw)


def _symgraph(p: Pair, **kw) -> Outcome:
    """``symgraph.align`` on the pair's reports with ``kw``, timed, as an interpolation outcome."""
    t0 = time.perf_counter()
    return _aligned(p, symgraph.align(p.a, p.b, report_a=p.report_a, report_b=p.report_b, **kw), t0)


def _aligned(p: Pair, al, t0: float, **extra) -> Outcome:
    b2 = al.apply(p.b)
    return Outcome(b_aligned=b2, alignment=al, seconds=time.perf_counter() - t0,
                   align_seconds=al.seconds.get("total", 0.0), extra=extra)


# --- interpolation methods -------------------------------------------------------------------


def vanilla(p: Pair) -> Outcome:
    """Plain weight averaging / interpolation, no alignment (every seed's baseline)."""
    return Outcome(b_aligned=p.b)


def verma2024(p: Pair) -> Outcome:
    """Verma & Elbayad 2024: permutations from activation correlations.

    Aligned: MLP units (Hungarian on cross-correlation), residual stream (one permutation for
    the whole stream, the paper's "All"), attention heads by nested matching (outer Hungarian
    over head pairs whose cost is the inner Hungarian on the head-dim correlation of the
    attention output, i.e. the features before the output projection), and the head-dim
    permutation found there is applied to Q and K as well as V/O, as the paper applies
    ``P_MHA`` to W_Q, W_K, W_V. Data: training-split batches through both models.

    Deviations: (1) symgraph scores the head-dim block with covariances normalised per head
    pair (not per-feature correlations) before the inner Hungarian; (2) LLaMA: Q/K head dims
    carry RoPE, where no permutation but the identity is a symmetry, so Q/K keep their
    order there; query heads are permuted only within their KV group (GQA), a constraint the
    paper (no GQA) never meets; (3) BERT-style post-LN and pre-LN blocks are treated alike
    (the residual class is whatever the graph ties together).
    """
    t0 = time.perf_counter()
    ra = p.perm_reports()[0]
    r = roles(ra)
    perm_inner = {g.id for g in ra.groups if g.outer and g.kind in PERMUTATION_FAMILY}
    sel = r.residual | r.mlp | r.heads | r.vo_inner | perm_inner
    al = _perm_align(p, data=p.data, inner="hungarian", groups=lambda g: g.id in sel)
    tied = _tie_qk_to_vo(ra, r, al)
    return _aligned(p, al, t0, qk_tied_to_vo=tied)


def _tie_qk_to_vo(report, r: Roles, al) -> int:
    """Give each QK-inner class the VO-inner element of its heads (Verma & Elbayad 2024's shared P_MHA)."""
    ga = report.groups
    n = 0
    for qk in sorted(r.qk_inner):
        if ga[qk].kind == "rope":
            continue  # only pair rotations are symmetries under RoPE
        for vo in r.vo_inner:
            E = al.elements.get(vo)
            if ga[vo].outer == ga[qk].outer and E is not None and ga[vo].dim == ga[qk].dim:
                al.elements[qk] = E.clone()
                n += 1
                break
    return n


def zhang2025(p: Pair) -> Outcome:
    """Zhang et al. 2024: data-free matching from weights.

    Aligned: MLP units by Hungarian on the weight inner products of both MLP matrices (and
    bias); per attention head an orthogonal Procrustes rotation for the QK pair and one for
    the VO pair, heads paired by index (no head permutation), residual stream not aligned.

    Deviations: (1) LLaMA's Q/K carry RoPE; a full rotation there would change the function,
    so the QK rotation is restricted to the 2×2 frequency-pair rotations that commute with
    RoPE (symgraph's ``rope`` class); (2) GQA: one rotation per KV head (shared by its query
    heads) for VO and QK; (3) weight similarities are computed after the already-solved
    classes are applied (coordinate descent, up to symgraph's ``max_iter`` sweeps), where the
    paper solves each layer once against the unaligned neighbours.
    """
    t0 = time.perf_counter()
    r = roles(p.perm_reports()[0])
    sel = r.mlp | r.continuous_inner
    al = _perm_align(p, inner="procrustes", groups=lambda g: g.id in sel)
    return _aligned(p, al, t0)


def zhang2025_rescale(p: Pair) -> Outcome:
    """:func:`zhang2025` with its scalar rescaling: after each head's rotation R, a scalar ``a > 0``
    per head and per QK / VO pair minimising ``‖W_A − a·R W_B‖² + ‖W'_A − R W'_B / a‖²``
    (the query/value side takes ``a``, the key/output side ``1/a``: a GL symmetry), fitted by
    ``symgraph.align(..., rescale=True)`` (``alignment.scales``).
    """
    t0 = time.perf_counter()
    r = roles(p.perm_reports()[0])
    sel = r.mlp | r.continuous_inner
    al = _perm_align(p, inner="procrustes", groups=lambda g: g.id in sel, rescale=True)
    out = _aligned(p, al, t0)
    out.extra["scales"] = {str(k): v for k, v in al.scales.items()}
    return out


def imfeld2024(p: Pair) -> Outcome:
    """Imfeld et al. 2024: OT fusion with soft Sinkhorn transport maps from activations.

    As in the seed's ViT configuration: activation-based ground metric, Sinkhorn with
    regularisation :data:`SINKHORN_REG` (0.08), soft maps for the MLP units and the residual
    stream; every class is aligned.

    Deviations: (1) the seed carries one transport map per residual branch and mixes them
    with a policy ("mean" in its config); symgraph's residual stream is a single class, so one
    soft map serves every residual point (the policy-free limit); (2) the seed ignores heads
    (one map over the full Q, K and V widths, Q and K even "separate"), which is not a
    symmetry of multi-head attention; here heads are matched by exact OT over head pairs (a
    hard map) with a Hungarian map inside each head, and Q/K share their head-dim map;
    (3) the ground cost is ``max(corr) − corr`` (correlations), not the seed's Euclidean
    distance between standardised activations; for standardised features these order pairs
    identically up to the max normalisation.
    """
    t0 = time.perf_counter()
    al = _perm_align(p, data=p.data, solver="sinkhorn", reg=SINKHORN_REG, inner="hungarian")
    return _aligned(p, al, t0)


def symgraph_weights_perm(p: Pair) -> Outcome:
    """symgraph_weights without norm folding: the residual stream stays a permutation class
    (the ablation of the residual rotations)."""
    t0 = time.perf_counter()
    return _aligned(p, _perm_align(p), t0)


def symgraph_activations_perm(p: Pair) -> Outcome:
    """symgraph_activations without norm folding (residual stream as a permutation)."""
    t0 = time.perf_counter()
    return _aligned(p, _perm_align(p, data=p.data), t0)


def symgraph_weights(p: Pair) -> Outcome:
    """symgraph, data-free: every class the report finds (residual stream, orthogonal where
    norm gains fold, MLP, head permutation with per-head inner rotations, RoPE pair rotations,
    GQA-shared elements), weight matching by coordinate descent."""
    return _symgraph(p)


def symgraph_weights_exact(p: Pair) -> Outcome:
    """symgraph_weights with every change taken (``until="exact"``, ``tol=0``: sweeps until
    nothing changes, at most ``max_iter``) and exact products: the reference the fast defaults
    are measured against."""
    return _symgraph(p, tol=0.0, similarity="exact", until="exact")


def symgraph_weights_bf16(p: Pair) -> Outcome:
    """symgraph_weights with every similarity product in bfloat16 (summed in float32)."""
    return _symgraph(p, similarity="bf16")


def symgraph_activations(p: Pair) -> Outcome:
    """symgraph from activations: every class, similarity from streamed activation
    correlations / covariances on the alignment data (weights where a class is not observed
    cleanly)."""
    return _symgraph(p, data=p.data)


def symgraph_weights_full(p: Pair) -> Outcome:
    """symgraph_weights, then the full groups fitted (``full_groups=True``: GL per head, RoPE
    pair scales, alternated with the residual streams)."""
    return _symgraph(p, full_groups=True)


def symgraph_activations_full(p: Pair) -> Outcome:
    """symgraph_activations, then the full groups fitted (``full_groups=True``)."""
    return _symgraph(p, data=p.data, full_groups=True)


#: Learned matching (symgraph_refine): steps, Adam step size, training batches for the loss.
REFINE_STEPS, REFINE_LR, REFINE_BATCHES = 200, 1e-3, 32


def symgraph_refine(p: Pair) -> Outcome:
    """Learned matching as ``align(..., refine=N)`` does it: from symgraph_activations or
    symgraph_weights, whichever gives the lower midpoint training loss, the elements are
    optimised so that the model interpolated at λ ~ U(0.4, 0.6) has low training loss
    (:data:`REFINE_STEPS` Adam steps on :data:`REFINE_BATCHES` training batches with labels;
    the benchmark's own loss)."""
    from symgraph.alignment.refine import choose_start, refine

    from . import evaluate
    t0 = time.perf_counter()
    starts = {"activations": symgraph.align(p.a, p.b, data=p.data, report_a=p.report_a, report_b=p.report_b),
              "weights": symgraph.align(p.a, p.b, report_a=p.report_a, report_b=p.report_b)}
    batches = evaluate.eval_batches(p.arch, "train", REFINE_BATCHES)
    loss_fn = lambda m, b: evaluate.batch_loss(m, p.arch, b)  # noqa: E731
    name, losses = choose_start(starts, p.a, p.b, batches, loss_fn)
    al = starts[name]
    al.refined = refine(al, p.a, p.b, batches, REFINE_STEPS, lr=REFINE_LR, progress=False,
                        loss_fn=loss_fn)
    al.refined.update(start=name, start_loss=losses)
    return _aligned(p, al, t0, refined=dict(al.refined))


# --- single merged model ---------------------------------------------------------------------


def _merge(p: Pair, method: str, align, repair: bool = False) -> Outcome:
    t0 = time.perf_counter()
    res = symgraph.merge([p.a, p.b], data=p.data, method=method, align=align, repair=repair)
    al = res.alignments[1]
    extra = {"repair": res.repair.to_dict()} if res.repair is not None else {}
    return Outcome(merged=res.model, alignment=al, seconds=time.perf_counter() - t0,
                   align_seconds=al.seconds.get("total", 0.0) if al is not None else 0.0,
                   extra=extra)


def vanilla_repair(p: Pair) -> Outcome:
    """Plain averaging, then REPAIR (``merge(..., align=None, repair=True)``) on the alignment
    data: hidden pre-activation statistics set to the parents' interpolation."""
    return _merge(p, "average", None, repair=True)


def symgraph_repair(p: Pair) -> Outcome:
    """symgraph activation matching, averaging, then REPAIR (``merge(..., align="activations",
    repair=True)``)."""
    return _merge(p, "average", "activations", repair=True)


def fisher(p: Pair) -> Outcome:
    """Fisher merging (Zhang et al. 2024's base): diagonal Fisher of each model's own predictions on
    the alignment data, no alignment."""
    return _merge(p, "fisher", None)


def fisher_aligned(p: Pair) -> Outcome:
    """Fisher merging after symgraph's weight matching (Zhang et al. 2024's "+match" uses data-free
    matching; here it is symgraph's full alignment rather than Zhang et al. 2024's subset)."""
    return _merge(p, "fisher", "weights")


def regmean(p: Pair) -> Outcome:
    """RegMean (Zhang et al. 2024's base): per linear layer ``(Σ W_i G_i)(Σ G_i)^{-1}`` with input Grams
    regularised towards their diagonal (α = 0.9), no alignment."""
    return _merge(p, "regmean", None)


def regmean_aligned(p: Pair) -> Outcome:
    """RegMean after symgraph's weight matching (Grams transformed with the weights)."""
    return _merge(p, "regmean", "weights")


#: name -> (function, short description). Order = table order.
METHODS: dict[str, tuple[Callable[[Pair], Outcome], str]] = {
    "vanilla": (vanilla, "plain averaging"),
    "verma2024": (verma2024, "Verma & Elbayad: activation perms (FFN, heads nested, residual)"),
    "zhang2025": (zhang2025, "Zhang et al.: FFN Hungarian + per-head Procrustes QK/VO, weights"),
    "zhang2025_rescale": (zhang2025_rescale, "Zhang et al. + per-head scalar rescaling"),
    "imfeld2024": (imfeld2024, "Imfeld et al.: OT fusion, soft Sinkhorn maps from activations"),
    "fisher": (fisher, "Fisher merging, no alignment"),
    "fisher_aligned": (fisher_aligned, "Fisher merging after symgraph weight matching"),
    "vanilla_repair": (vanilla_repair, "plain averaging + REPAIR"),
    "symgraph_repair": (symgraph_repair, "symgraph activation matching + averaging + REPAIR"),
    "regmean": (regmean, "RegMean, no alignment"),
    "regmean_aligned": (regmean_aligned, "RegMean after symgraph weight matching"),
    "symgraph_weights_perm": (symgraph_weights_perm, "symgraph weight matching, residual as a permutation"),
    "symgraph_activations_perm": (symgraph_activations_perm,
                                  "symgraph activation matching, residual as a permutation"),
    "symgraph_weights": (symgraph_weights, "symgraph, all classes, weight matching"),
    "symgraph_activations": (symgraph_activations, "symgraph, all classes, activation matching"),
    "symgraph_weights_exact": (symgraph_weights_exact, "symgraph weight matching, tol=0, exact products"),
    "symgraph_weights_bf16": (symgraph_weights_bf16, "symgraph weight matching, bf16 products"),
    "symgraph_refine": (symgraph_refine, "symgraph learned matching (from activations or weights)"),
    "symgraph_weights_full": (symgraph_weights_full, "symgraph weight matching + full groups (GL, RoPE scales)"),
    "symgraph_activations_full": (symgraph_activations_full, "symgraph activation matching + full groups"),
}

#: Methods that are symgraph's own (the "some symgraph method beats vanilla" check).
SYMGRAPH_METHODS = ("symgraph_weights_perm", "symgraph_activations_perm", "symgraph_weights",
                    "symgraph_weights_exact", "symgraph_weights_bf16",
                    "symgraph_activations", "symgraph_refine", "symgraph_repair", "symgraph_weights_full",
                    "symgraph_activations_full")

#: The published ("seed") methods the suite compares against, named after their papers.
SEED_METHODS = ("verma2024", "zhang2025", "zhang2025_rescale", "imfeld2024")

#: One line per seed method: what differs from the paper (also in each docstring).
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

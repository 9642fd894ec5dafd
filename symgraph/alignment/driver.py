"""``align()``: fill every class of the report with a group element or transport map that
carries model B into model A's basis."""
from __future__ import annotations

import time

import torch

from ..report.api import analyze
from ..report.symmetry import SymmetryReport
from ..transform.apply import check_model
from ..errors import InputError, StructureMismatchError
from ..core.configs import check_same_family, with_config_diff
from ..core.finite import batch_list, require_module
from ..transform.folding import gauge
from .activations import act_matrix, activation_similarity
from .checks import check_compatible, check_finite, check_movable
from .masses import mass_function
from .options import AlignOptions
from .pairs import start_pairs
from .learning import learned_matching
from .refine import InMemory
from .fullgroups import ModelSides, fit_full_groups
from .rescale import fit_scales
from .result import Alignment
from .sweeps import Sweeps
from .weights import WeightFeatures

__all__ = ["AlignOptions", "align", "align_tensors"]


def align(model_a, model_b, inputs=None, *, data=None, report_a=None, report_b=None,
          options: AlignOptions | None = None, **option_kw) -> Alignment:
    """Align ``model_b`` to ``model_a``'s basis; returns an :class:`Alignment`.

    inputs : example inputs (tuple / dict), default from the config (HF) or the first batch.
    data : iterable of batches in the same form as ``inputs``: similarity from activations
        where a class is observed cleanly, from weights elsewhere. Without it, weights only.
    report_a, report_b : reuse reports already computed for the two models.
    options / keywords : an :class:`~symgraph.alignment.options.AlignOptions` (``solver``,
        ``inner``, ``max_iter``, ``until``, ``groups``, ``refine``, ``sketch``, ``tol``, ...), or
        its fields as keywords (a keyword replaces that field of ``options``).
    """
    opts = AlignOptions.build(options, **option_kw)
    for m, label in ((model_a, "model_a"), (model_b, "model_b")):
        require_module(m, label)
        check_finite(m, label, values=True)
    check_same_family([model_a, model_b], ["model_a", "model_b"], StructureMismatchError)
    try:
        return _aligned(model_a, model_b, inputs, data, report_a, report_b, opts)
    except StructureMismatchError as e:  # how their configs differ says more than a graph node
        raise with_config_diff(e, [model_a, model_b], ["model_a", "model_b"]) from None


def _aligned(model_a, model_b, inputs, data, report_a, report_b, opts) -> Alignment:
    """:func:`align` once its arguments are checked."""
    data = batch_list(data, model_a, model_b)
    inputs = data[0] if inputs is None and data is not None else inputs
    for rep, label, m in ((report_a, "report_a", model_a), (report_b, "report_b", model_b)):
        if rep is not None and not isinstance(rep, SymmetryReport):
            raise InputError(f"{label} is a {type(rep).__name__}; expected a SymmetryReport (symgraph.analyze of "
                             "the model), or None")
        if rep is not None:
            check_model(rep, m, label.replace("report", "model"))
    t0 = time.perf_counter()
    ra = report_a or analyze(model_a, inputs, fold_norms=opts.fold_norms, outputs=opts.outputs)
    rb = report_b or analyze(model_b, inputs, fold_norms=opts.fold_norms, outputs=ra.outputs)
    t_an = time.perf_counter() - t0
    check_movable(ra)
    check_compatible(ra, rb)
    if opts.refine and data is None:
        raise InputError(f"refine={opts.refine} needs data: batches to compute the loss on")
    al = _solved(ra, rb, model_a, model_b, data, opts)
    al.seconds["analyze"] = t_an
    al.options = _report_options(opts, ra)
    if opts.refine:
        al = _refined(al, model_a, model_b, data, opts)
    if opts.full_groups:
        al.full_groups = fit_full_groups(al, ModelSides(model_a, model_b), opts)
    if opts.rescale:
        al.scales = fit_scales(al, model_a, model_b, [g for g in ra.groups if opts.selected(g)])
    al.seconds["total"] = time.perf_counter() - t0
    return al


def _with_activations(run, ra, rb, b_of, data, models, sweeps, fetch=None, budget=None, device=None):
    """Point ``run`` at activation similarity where a class is observed on ``data`` (weights,
    given the rest, elsewhere); returns the statistics (None without data) and the number of
    sweeps: one when every class is observed, unless transport masses read other classes' maps.

    With ``budget`` (bytes), when widths are equal and masses are "auto" (no activation solve
    then reads another class), the statistics are taken in passes of about ``budget`` bytes,
    and each unit whose similarity is all observed is solved, and its statistics dropped, as
    soon as its last pass is done; :meth:`Sweeps.run` takes it as solved at its place in the
    first sweep, so the other units see what they would have seen. Memory holds one pass's
    statistics (and those of head families still waiting for a member)."""
    if data is None:
        return None, sweeps
    by_weights = run.similarity
    pairs = [(ga, b_of[ga.id]) for ga in ra.groups]
    equal = all(g.size == b_of[g.id].size for g in ra.groups)
    early = budget is not None and run.opts.masses == "auto" and equal
    stats: dict = {}

    def by_activations(ga, cross, usable=None):
        m = act_matrix(stats[ga.id], ga, cross)
        return (m, True, frozenset()) if m is not None else by_weights(ga, cross, usable)

    def solve_done(ids, got):  # a pass is complete: its classes' statistics are final
        stats.update(got)
        done.update(pairs[i][0].id for i in ids)
        for ui, unit in enumerate(run.units):
            gids = run.ids(unit)
            reads = {g.id for g in run.solved_groups(unit)}  # a head family reads its members only
            if ui not in run.presolved and gids <= done and all(stats[g].n > 0 for g in reads):
                run.solve_early(ui)
                for g in gids:
                    stats[g].release()

    done: set = set()
    run.similarity = by_activations
    stats.update(activation_similarity(ra, rb, data, pairs, models=models, fetch=fetch,
                                       on_done=solve_done if early else None, budget=budget, device=device))
    if equal and all(stats[g.id].n > 0 for g in ra.groups):
        sweeps = 1
    return stats, sweeps


def _report_options(opts, ra) -> dict:
    """What a model must be analysed with for an alignment to apply to it (kept when saved)."""
    return {"fold_norms": bool(opts.fold_norms), "outputs": list(ra.outputs) if ra.outputs else None}


def _solved(ra, rb, model_a, model_b, data, opts) -> Alignment:
    """One alignment of the models: weight matching, with activation statistics from ``data``."""
    feats = WeightFeatures.from_models(ra, rb, model_a, model_b, products=opts.similarity,
                                       sketch=opts.sketch, rows=opts.rows,
                                       block_scale=opts.block_scale, head_cost=opts.head_cost)
    fetch = None if data is None else (_reader(model_a), _reader(model_b))  # not the reports' own
    run, n_sweeps = _solve(ra, rb, feats, opts, data, (model_a, model_b), fetch,
                           device=None if data is None else _device(model_a))
    return Alignment(ra, rb, run.elements, run.results, "weights" if data is None else "activations",
                     {"solver": run.solver_seconds, "sweeps": n_sweeps, "deferred": run.deferred},
                     template=model_a, gauge=gauge(ra.folds, dict(model_a.named_parameters())),
                     shared=run.shared)


def _reader(model):
    """``name -> tensor`` of ``model``'s parameters and buffers: the activation statistics run
    the graphs on the models given, whatever model a report passed in was traced from (the
    same report for A and B ran A's weights twice: every class came back as the identity)."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return lambda name: named[name].detach()


def _device(model):
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _refined(al, model_a, model_b, data, opts) -> Alignment:
    """Learned matching, started from whichever of ``al`` (activations) and weight matching
    alone gives the model halfway between A and B the lower loss on ``data`` (the loss refine
    lowers; neither wins everywhere: weights did on the medium LLaMA pair, activations on the
    quick one). ``refined["start"]`` says which, ``refined["start_loss"]`` their losses."""
    t0 = time.perf_counter()
    starts = {"activations": al, "weights": _solved(al.report_a, al.report_b, model_a, model_b, None, opts)}
    return learned_matching(starts, InMemory(model_a, model_b, opts.loss_fn, opts.between), data, opts.refine,
                            opts.refine_lr, t0)


def _solve(ra, rb, feats, opts, data=None, models=None, fetch=None, budget=None, device=None):
    """Fill ``ra``'s classes (coordinate descent over weight similarity, activation statistics
    where ``data`` observes a class); returns the loop and the number of sweeps it ran."""
    run, b_of = _sweeps(ra, rb, feats, opts)
    stats, sweeps = _with_activations(run, ra, rb, b_of, data, models, opts.max_iter, fetch, budget, device)
    run.masses = mass_function(feats, b_of, opts.masses, stats, run.elements)
    start_pairs(run, feats, observed=lambda g: stats is not None and stats[g.id].n > 0)
    try:
        return run, run.run(sweeps)
    finally:
        feats.release()


def _sweeps(ra, rb, feats, opts):
    """The coordinate-descent loop over ``ra``'s classes with weight similarity, and the map
    from A's group ids to B's groups."""
    run = Sweeps(ra, opts, feats, None)
    b_of = dict(zip((g.id for g in ra.groups), rb.groups))

    def by_weights(ga, cross, usable=None):
        return feats.similarity(ga, b_of[ga.id], run.elements, cross, usable)
    run.similarity = by_weights
    return run, b_of


def align_tensors(ra, rb, tensors_a, tensors_b, gauge_a: dict, options: AlignOptions | None = None,
                  exact_dtype=torch.float64, data=None, models=None, fetch=None, stats_budget=None,
                  sides=None, device=None, **option_kw) -> Alignment:
    """Alignment from tensors rather than modules: ``tensors_a`` / ``tensors_b`` map each
    parameter name of the reports to its tensor (any ``Mapping``; a lazy one reads them on
    demand, see :mod:`symgraph.merging.streaming`); ``gauge_a``: A's norm gains and shifts
    (:func:`symgraph.transform.folding.gauge`); ``exact_dtype``: what rotations are solved in (see
    :class:`~.weights.WeightFeatures`). Weight matching; with ``data``, activation statistics
    where a class is observed, the graphs run op by op on ``fetch`` (two functions ``name ->
    tensor`` reading each model's parameters and buffers when an op needs them) and retraced
    from ``models`` (A, B; may be on ``meta``) for batches of other shapes, on ``device`` (the
    CPU when None: where the tensors' similarities are computed); ``stats_budget``
    (bytes): statistics taken in passes and solved as each completes (see
    :func:`_with_activations`). ``full_groups`` reads the stored tensors through ``sides``
    (see :mod:`~.fullgroups`; :class:`symgraph.merging.engine.views.Sides` reads checkpoints), released
    at the end. The result has no
    template (``Alignment.state`` works; ``apply`` needs a ``template``)."""
    opts = AlignOptions.build(options, **option_kw)
    if opts.refine or opts.rescale:
        raise InputError("refine and rescale need the models themselves; use symgraph.align")
    if opts.full_groups and sides is None:
        raise InputError("full_groups from tensors needs sides: A's stored tensors and B's in A's basis "
                         "(symgraph.merging.engine.views.Sides); use symgraph.align for models")
    if data is not None and fetch is None:
        raise InputError("activation statistics from tensors need fetch: two functions name -> tensor")
    t0 = time.perf_counter()
    check_movable(ra)
    check_compatible(ra, rb)
    feats = WeightFeatures(ra, rb, tensors_a, tensors_b, exact_dtype, products=opts.similarity,
                           sketch=opts.sketch, rows=opts.rows,
                                       block_scale=opts.block_scale, head_cost=opts.head_cost)
    run, n_sweeps = _solve(ra, rb, feats, opts, data, models, fetch, stats_budget, device)
    al = Alignment(ra, rb, run.elements, run.results, "weights" if data is None else "activations",
                   {"solver": run.solver_seconds, "sweeps": n_sweeps, "deferred": run.deferred}, gauge=gauge_a,
                   shared=run.shared)
    al.options = _report_options(opts, ra)
    if opts.full_groups:
        al.full_groups = fit_full_groups(al, sides, opts)
    elif sides is not None:
        sides.release()
    al.seconds["total"] = time.perf_counter() - t0
    return al

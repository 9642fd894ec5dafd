"""``merge()``: models in memory merged from one :class:`~.config.MergeConfig` (given, or built
from the keywords by the same rules) by the merge engine over them (:mod:`.streaming`), which
aligns them to an anchor and combines them (a shared universe: :mod:`.universe`'s rounds)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from ..core.progress import bar as progress_bar
from ..core.schema import UNSET
from ..core.finite import batch_list, require_bool, require_list, require_module
from ..core.ties import check_ties, check_untie, untie as untie_model

from ..alignment import align as align_models
from ..alignment.checks import check_finite
from ..report.api import analyze
from ..errors import InputError, StructureMismatchError
from ..checkpoints.memory import ModelCheckpoint
from ..checkpoints.specs import check_same_configs, check_same_family, with_config_diff
from .circuits import circuit_state, plan, why_no_config, widened_program
from .config import MergeConfig, engine_config, solver_options
from .methods import registry
from .methods.registry import mixing_weights
from .repair import RepairReport
from .streaming import StreamingMerge

IN_MEMORY_ONLY = ("loss_fn", "between", "rescale")  # align options only symgraph.align takes: it aligns
ON_DISK = ("out", "force", "max_shard_size", "memory_budget")  # options of a merge written out of core

__all__ = ["MergeResult", "merge", "circuit_merge", "circuit_between"]


@dataclass
class MergeResult:
    """What :func:`merge` returns: the merged ``model`` (the anchor's architecture and dtypes),
    one :class:`~symgraph.Alignment` per input model (None for the anchor and when not
    aligned; with ``anchor="universe"`` every model's), ``timings`` in seconds (``analyze``,
    ``align``, ``statistics``, ``combine``, ``repair``, ``total``), ``repair`` (the
    :class:`~symgraph.merging.repair.RepairReport`, with ``repair=True``) and ``universe``
    (what the rounds did: :func:`~symgraph.merging.universe.rounds`' record)."""
    model: torch.nn.Module
    alignments: list
    timings: dict = field(default_factory=dict)
    repair: RepairReport | None = None
    universe: dict | None = None


def merge(models, inputs=None, *, weights=UNSET, align=UNSET, data=None, method=UNSET,
          anchor: int | str = UNSET, method_options: dict | None = UNSET, progress: bool = False,
          repair: bool = UNSET, universe_options: dict | None = None, attention: str = UNSET,
          untie: bool = UNSET, config=None, **align_options) -> MergeResult:
    """Merge ``models`` (N ≥ 2) into a new model of the anchor's architecture.

    The options a :class:`~symgraph.app.config.MergeConfig` holds (``weights``, ``align``,
    ``method``, ``anchor``, ``method_options``, ``repair``, ``attention``, ``untie`` and the
    config's fields among ``align_options``) are unset unless given: their defaults are the
    config's, and with ``config=`` any of them given is refused, even at its default's value.

    align : "weights" (data-free, the default), "activations" (needs ``data``; refine's default and only value) or None.
    method : a registered name (``symgraph.merge_methods()``; default "average") or a
        :class:`~symgraph.merging.MergeMethod` instance; ``method_options``: its parameters.
    weights : per-model mixing weights (default uniform).
    anchor : the index (default 0) of the model whose basis the others are aligned to, or "universe":
        every model aligned to the mean of the others (:mod:`symgraph.merging.universe`,
        ``universe_options``: ``max_rounds``, ``tol``), in models[0]'s architecture.
    repair : REPAIR (Jordan et al. 2023; :mod:`symgraph.merging.repair`; default off): every hidden channel
        that feeds a nonlinearity gets, on ``data`` (required), the mean and std interpolated
        from the models in A's basis; BatchNorm layers get their running statistics recomputed.
    progress : a progress bar (stderr) over the models.
    attention : "heads" (the default) or "circuits": every head interpolates its ``QKᵀ`` and ``OV`` forms,
        in heads N times as wide (:mod:`symgraph.merging.circuits`; method "average" only).
    untie : give tied weights their own tensors first (:func:`symgraph.core.ties.untie`; default off).
    align_options : :class:`~symgraph.AlignOptions` fields (``solver``, ``inner``, ...).
    config : a :class:`~symgraph.app.config.MergeConfig` (the command line's and YAML's)
        giving the options instead of the keywords above, which are then left unset
        (``inputs``, ``data``, ``progress``, ``universe_options`` and solver options aside);
        one entry of its ``models`` per model; its on-disk options are ``run_merge``'s.
    """
    t0 = time.perf_counter()
    require_bool(progress, "progress")
    models, data = _model_list(models, data)
    given = dict(weights=weights, align=align, method=method, anchor=anchor, method_options=method_options,
                 repair=repair, attention=attention, untie=untie)
    config, align_options = _config(models, config, given, data, align_options)
    if config.align == "none" and align_options:
        raise InputError(f"{sorted(align_options)[0]}= is an option of the alignment, and align=None aligns "
                         "nothing; expected align='weights' or 'activations' with it (or no alignment option)")
    models, how = _prepared(models, config, method, data, universe_options)
    inputs = data[0] if inputs is None and data is not None else inputs
    A = models[0 if config.anchor == "universe" else config.anchor]
    try:
        job, ra, alignments, universe, timings = _alignments(models, config, how, data, inputs, align_options,
                                                             universe_options, progress)
        result = _combined(models, A, ra, alignments, config, lambda: job or _engine(models, config, how, data),
                           timings)
    except StructureMismatchError as e:  # how their configs differ says more than a graph node
        raise with_config_diff(e, models, config.models) from None
    result.universe = universe
    timings["total"] = time.perf_counter() - t0
    return result


def _alignments(models, config, how, data, inputs, align_options, universe_options, progress) -> tuple:
    """``(job, report, alignments, universe, timings)``: every model aligned into the anchor's
    basis, or into a shared universe in rounds, by the merge engine over the models (``job``),
    which then combines them; by :func:`symgraph.align` where an option only it takes is given
    (a loss, ``between``, ``rescale``: not in a universe's rounds); unaligned, the anchor analysed
    once for the engine that combines them."""
    t0 = time.perf_counter()
    A = models[0 if config.anchor == "universe" else config.anchor]
    timings = {"analyze": 0.0, "align": 0.0, "statistics": 0.0}
    only = sorted(set(IN_MEMORY_ONLY) & set(align_options))
    if only and config.anchor == "universe":
        raise InputError(f"anchor='universe' aligns in the merge engine's rounds, which take no {only[0]}; "
                         "expected it with an anchor index (or anchor='universe' without it)")
    if not only and config.align != "none":  # the engine aligns (unaligned: the anchor analysed below)
        rounds = {"universe": universe_options} if config.anchor == "universe" else {}  # the engine's rounds
        job = _engine(models, config, how, data, aligning=dict(align_options, inputs=inputs, **rounds),
                      progress=progress)
        alignments, universe, ra = job.align(), job.universe, job.report
        for al in alignments:
            if al is not None:
                al.template = A  # a merge across widths applies it to B in A's shapes
        timings.update(analyze=job.timings.get("analyze", 0.0),
                       align=universe["seconds"] if universe else job.timings.get("align", 0.0))
        return job, ra, alignments, universe, timings
    ra, align_options = _analysed(A, inputs, config, data, align_options)
    timings["analyze"] = time.perf_counter() - t0
    bar = progress_bar(models, desc=f"aligning (align={config.align})", unit="model",
                       enabled=progress and config.align != "none")
    alignments = [None if i == config.anchor or config.align == "none"  # unaligned: the engine refuses other shapes
                  else align_models(A, m, inputs, report_a=ra, **align_options) for i, m in enumerate(bar)]
    timings["align"] = time.perf_counter() - t0 - timings["analyze"]
    return None, ra, alignments, None, timings


def _analysed(A, inputs, config, data, align_options) -> tuple:
    """``(report, align_options)``: the anchor analysed, and the options :func:`symgraph.align`
    takes for this config (activation matching's data, the solver's options, seen rows)."""
    ra = analyze(A, inputs, fold_norms=config.fold_norms, outputs=config.outputs)
    return ra, dict(align_options, refine=config.refine, fold_norms=config.fold_norms, outputs=config.outputs,
                    data=data if config.align == "activations" else None,  # what aligning reads
                    **solver_options(config),
                    **({"rows": ra.input_rows(data)} if config.seen_rows else {}))  # Theus et al. 2025


def _prepared(models, config, method, data, universe_options) -> tuple:
    """``(models, method)``: the models refused where their classes or configs differ (a field
    that changes the function: the merge would silently follow the anchor's), untied if the
    config asks (refused where nothing is tied), else checked for ties; the method the config
    names (or the instance given)."""
    if universe_options is not None and config.anchor != "universe":
        raise InputError(f"universe_options={universe_options!r} apply only with anchor='universe', not "
                         f"anchor={config.anchor!r}")
    check_same_family(models, config.models)
    check_same_configs([getattr(m, "config", None) for m in models], config.models, untie=config.untie)
    if config.untie:
        check_untie(models, config.models)
        models = [untie_model(m) for m in models]
    else:  # a tied model beside its untied form (symgraph.rotate's): one function, merged untied if asked
        check_ties(models)
    instance = method is not UNSET and not isinstance(method, str)  # a MergeMethod the config does not name
    how = registry.get(method) if instance else registry.get(config.method, **config.parameters)
    if how.needs_data and data is None:  # a method instance the config does not name
        raise InputError(f"method={how.name!r} needs data (an iterable of batches)")
    return models, how


def _combined(models, A, ra, alignments, config, engine, timings) -> MergeResult:
    """The models combined by the merge engine (``engine()`` builds it) in A's architecture
    (circuits in a widened traced program where A's config cannot state wider heads, without
    an engine: its config refuses them)."""
    t3 = time.perf_counter()
    if config.attention == "circuits" and why_no_config(A, len(models)):  # a traced program widened: in memory
        out = _circuits_without_config(models, alignments, mixing_weights(config.weights, len(models)),
                                       config.anchor, ra)
        timings["combine"] = time.perf_counter() - t3
        return MergeResult(out, alignments, timings)
    job = engine()
    if job.report is not ra:  # alignments found outside the engine (an engine that aligned holds them)
        job.use(ra, alignments)
    out = job.merged_model(A)
    timings["statistics"] = job.timings.get("statistics", 0.0)
    timings["combine"] = time.perf_counter() - t3 - timings["statistics"]
    if job.repair_report is not None:  # written with repair=True
        timings["repair"] = job.repair_report.seconds
    return MergeResult(out, alignments, timings, job.repair_report)


def _model_list(models, data) -> tuple:
    """``(models, data)`` as lists: each model a ``torch.nn.Module``, or refused in one line (one
    module, not a list of them, is refused too: an ``nn.Sequential`` would iterate over its
    layers); the batches checked against them (:func:`~symgraph.core.finite.batch_list`)."""
    require_list(models, "models", "a list of torch.nn.Module models (at least 2)", (torch.nn.Module,))
    models = list(models)
    for i, m in enumerate(models):
        require_module(m, f"models[{i}]", "a torch.nn.Module in memory (merge checkpoints on disk with "
                       "symgraph.merge_checkpoints)")
    return models, batch_list(data, *models)


def _config(models, config, given: dict, data, align_options: dict) -> tuple:
    """``(config, align_options)`` of a merge of ``models``: ``config``, refused in one line
    where a keyword (``given``, ``align_options``) sets an option too, or built from the
    keywords by the config's rules (:func:`~.config.engine_config`; a negative anchor counts
    from the end); the models and data checked."""
    if len(models) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(models)}")
    for i, m in enumerate(models):
        check_finite(m, f"model {i}", values=True)
    given = {k: v for k, v in given.items() if v is not UNSET}  # the keywords set; the others are the config's
    disk = sorted(set(ON_DISK) & set(align_options))
    if disk:
        raise InputError(f"merge() returns the merged model in memory, and {disk[0]}= is an option of a merge "
                         "written to disk; expected symgraph.merge_checkpoints(paths, out, ...) for checkpoints "
                         "(or result.model.save_pretrained(directory))")
    if config is None:
        n, a = len(models), given.get("anchor", 0)
        if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
            a = int(a) + n if -n <= a < 0 else int(a)
        options = {**{k: v for k, v in given.items() if k != "method"}, "anchor": a, **align_options}
        return engine_config([f"model {i}" for i in range(n)], None, options, data, given.get("method"))
    both = sorted(given) + sorted(set(MergeConfig.model_fields) & set(align_options))
    if both:
        raise InputError(f"merge(config=...) takes its options from the config, and {both[0]}= sets one too; "
                         f"expected {both[0]} in the MergeConfig (or no config)")
    if len(config.models) != len(models):
        raise InputError(f"the config names {len(config.models)} models and merge() was given {len(models)}; "
                         "expected one config entry per model")
    if config.takes_statistics and data is None:
        raise InputError("the config's merge takes statistics on data (activations, refine, repair or its method); "
                         "expected data=[batches]")
    return config, align_options


def _engine(models, config, how, data, aligning=None, progress=False) -> StreamingMerge:
    """The merge engine over ``models`` in memory (:class:`ModelCheckpoint` s), on their
    device, without a memory budget: with ``aligning`` (the alignment's options, ``inputs``
    among them) it aligns them itself, else the alignments are given to it."""
    device = next((p.device for p in models[0].parameters()), torch.device("cpu"))
    update = dict(device=str(device), untie=False, memory_budget=None, out=None)
    if config.attention == "circuits" and why_no_config(models[config.anchor], len(models)):
        update["attention"] = "heads"  # it aligns only: the circuits are merged in a widened program
    cfg = config.model_copy(update=update if aligning is not None else dict(update, refine=0))
    rows = {"rows_from": data} if aligning is not None and config.seen_rows else {}
    return StreamingMerge([ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models)], cfg,  # data: if used
                          data=data if how.needs_data or config.takes_statistics else None, method=how,
                          progress=progress, **(aligning or {}), **rows)


def _circuits_without_config(models, alignments, w, anchor, ra):
    """Circuit-space heads for a model whose config cannot state them: the parents' traced
    program widened (:func:`~symgraph.merging.circuits.widened_program`), in memory only."""
    parents = [m if al is None else al.apply(m) for m, al in zip(models, alignments)]
    parents = parents[anchor:anchor + 1] + parents[:anchor] + parents[anchor + 1:]
    ws = [w[anchor]] + [x for i, x in enumerate(w) if i != anchor]
    return circuit_merge(parents, ws, ra)  # the head classes do not depend on folding


def circuit_merge(models, weights, report):
    """Circuit-space merge of ``models`` (aligned, one architecture; ``report`` the anchor's)
    with mixing ``weights``, heads ``len(models)`` times as wide: the merge engine's (its
    circuit-space transform, :class:`~.circuits.CircuitHeads`) into the parents' model class
    where a config can state the head size, else their traced program widened
    (:func:`~.circuits.widened_program`, in memory only)."""
    A = models[0]
    why = why_no_config(A, len(models))
    if why is not None:
        return widened_program(models, weights, report, why)
    job = StreamingMerge([ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models)], align=None,
                         attention="circuits", weights=[float(w) for w in weights], device=next(A.parameters()).device)
    job.use(report, [None] * len(models))
    return job.merged_model(A)


def circuit_between(model_a, report=None):
    """Learned matching in circuit space (Theus et al. 2025): ``between(θ_A, θ_B′, λ)`` gives
    the circuit-space model of A and B′ with weights ``(1 − λ, λ)`` on those (differentiable)
    tensors, for ``symgraph.align(..., refine=N, between=circuit_between(A))``."""
    from ..alignment.refine import Bound
    report = report if report is not None else analyze(model_a)
    why = why_no_config(model_a, 2)
    cplan = plan(report, query_scale=why is None)
    skeleton = circuit_merge([model_a, model_a], [0.5, 0.5], report)

    def between(ta, tb, lam):
        state = circuit_state([ta, tb], [1 - lam, lam], cplan)
        return skeleton.with_state(state) if why else Bound(skeleton, state)
    return between

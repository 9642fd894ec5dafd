"""``merge()``: align N models to an anchor (or to a shared universe, :mod:`.universe`), move
each method's statistics with the weights, combine. Buffers that a group moves (the anchor
report's ``buffers``: running statistics) are the weighted average of the models' buffers in
A's basis; every other buffer is the anchor's."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from ..core.progress import bar as progress_bar

from ..alignment import align as align_models
from ..alignment.checks import check_finite
from ..report.api import analyze
from ..errors import InputError
from ..checkpoints.memory import ModelCheckpoint
from .circuits import circuit_merge, why_no_config
from .config import solver_options
from .methods import registry
from .methods.registry import mixing_weights
from .repair import RepairReport
from .streaming import StreamingMerge

__all__ = ["MergeResult", "merge"]


@dataclass
class MergeResult:
    """What :func:`merge` returns: the merged ``model`` (the anchor's architecture and dtypes),
    one :class:`~symgraph.Alignment` per input model (None for the anchor and when not
    aligned; with ``anchor="universe"`` every model's), ``timings`` in seconds (``analyze``,
    ``align``, ``statistics``, ``combine``, ``repair``, ``total``), ``repair`` (the
    :class:`~symgraph.merging.repair.RepairReport`, with ``repair=True``) and ``universe``
    (what the rounds did: :func:`~symgraph.merging.universe.align_universe`'s record)."""
    model: torch.nn.Module
    alignments: list
    timings: dict = field(default_factory=dict)
    repair: RepairReport | None = None
    universe: dict | None = None


def merge(models, inputs=None, *, weights=None, align="weights", data=None, method="average",
          anchor: int | str = 0, method_options: dict | None = None, progress: bool = False,
          repair: bool = False, universe_options: dict | None = None, attention: str = "heads",
          untie: bool = False, config=None, **align_options) -> MergeResult:
    """Merge ``models`` (N ≥ 2) into a new model of the anchor's architecture.

    align : "weights" (data-free), "activations" (needs ``data``) or None (no alignment).
    method : a registered name (``symgraph.merge_methods()``: "average", "fisher",
        "regmean", ...) or a :class:`~symgraph.merging.MergeMethod` instance;
        ``method_options`` go to its constructor (e.g. ``{"alpha": 0.5}`` for RegMean).
    weights : per-model mixing weights (default uniform).
    anchor : the index of the model whose basis the others are aligned to, or "universe":
        align every model to the mean of the others until no element changes (MergeMany;
        :mod:`symgraph.merging.universe`, options ``universe_options``: ``max_rounds``,
        ``tol``); the result has models[0]'s architecture and every model an alignment.
    repair : REPAIR (Jordan et al. 2023; :mod:`symgraph.merging.repair`): every hidden channel
        that feeds a nonlinearity gets, on ``data`` (required), the mean and std interpolated
        from the models in A's basis; BatchNorm layers get their running statistics recomputed.
    progress : a progress bar (stderr) over the models.
    attention : "heads" (the parents' architecture) or "circuits": every head interpolates its
        ``QKᵀ`` and ``OV`` forms, in heads N times as wide (Theus et al. 2025;
        :mod:`symgraph.merging.circuits`; method "average" only).
    untie : give tied weights (GPT-2's head and embedding) their own tensors first
        (:mod:`symgraph.merging.untie`), so the residual stream admits orthogonal maps; the
        merge has ``tie_word_embeddings=False``.
    align_options : :class:`~symgraph.AlignOptions` fields (``solver``, ``inner``, ...).
    config : a :class:`~symgraph.app.config.MergeConfig` (the command line's and YAML's)
        giving the options instead of the keywords above, which are then left unset
        (``inputs``, ``data``, ``progress``, ``universe_options`` and solver options aside);
        one entry of its ``models`` per model; its on-disk options are ``run_merge``'s.
    """
    if config is not None:
        given = dict(weights=weights, align=align, method=method, anchor=anchor, method_options=method_options,
                     repair=repair, attention=attention, untie=untie)
        return merge(models, inputs, data=data, progress=progress, universe_options=universe_options,
                     **_from_config(config, list(models), data, given, align_options))
    t0 = time.perf_counter()
    models, data = list(models), (list(data) if data is not None else None)
    models, how, align, w, anchor = _checked(models, method, method_options, align, data, weights, repair,
                                             anchor, universe_options, attention, untie)
    inputs = data[0] if inputs is None and data is not None else inputs
    A = models[0 if anchor == "universe" else anchor]
    ra = analyze(A, inputs, fold_norms=align_options.get("fold_norms", True),
                 outputs=align_options.get("outputs"))
    timings = {"analyze": time.perf_counter() - t0, "align": 0.0, "statistics": 0.0}
    universe, found, job = None, None, None
    if anchor == "universe":  # every model's alignment to the mean of the others, the engine's rounds
        from .universe import align_universe
        job = _engine(models, how, align, anchor, w, data, repair, attention, align_options)
        found, universe = align_universe(job, models, inputs, ra, data, universe_options, progress, **align_options)
        timings["align"] = universe["seconds"]
    t1 = time.perf_counter()
    alignments = found or _aligned(models, A, ra, inputs, align, data, anchor, progress, align_options)
    timings["align"] += time.perf_counter() - t1 if not found else 0.0
    t3 = time.perf_counter()
    if attention == "circuits" and why_no_config(A, len(models)):  # a traced program widened: in memory only
        out = _circuits_without_config(models, alignments, w, anchor, ra)
        timings["combine"] = time.perf_counter() - t3
        timings["total"] = time.perf_counter() - t0
        return MergeResult(out, alignments, timings, None, universe)
    job = job or _engine(models, how, align, anchor, w, data, repair, attention, align_options)
    job.use(ra, alignments)
    out = job.merged_model(A)
    timings["statistics"] = job.timings.get("statistics", 0.0)
    timings["combine"] = time.perf_counter() - t3 - timings["statistics"]
    repaired = job.repair_report
    if repair:
        assert repaired is not None  # written with repair=True
        timings["repair"] = repaired.seconds
    timings["total"] = time.perf_counter() - t0
    return MergeResult(out, alignments, timings, repaired, universe)


def _checked(models, method, method_options, align, data, weights, repair, anchor, universe_options, attention,
             untie) -> tuple:
    """``(models, method, align, weights, anchor)`` checked: the models untied if asked, the
    method built, the alignment mode, the normalised mixing weights and the anchor."""
    if attention not in ("heads", "circuits"):
        raise InputError(f"attention={attention!r}; expected 'heads' or 'circuits'")
    if untie:
        from .untie import untie as untie_model
        models = [untie_model(m) for m in models]
    how = registry.get(method, **(method_options or {}))
    if attention == "circuits" and (how.name != "average" or repair or anchor == "universe"):
        raise InputError("attention='circuits' merges by weighted averaging to one anchor; expected "
                         "method='average' without repair or a universe")
    align, w = _check_arguments(models, how, align, data, weights, repair)
    return models, how, align, w, _check_anchor(anchor, len(models), align, universe_options)


def _aligned(models, A, ra, inputs, align, data, anchor, progress, align_options) -> list:
    """One :class:`~symgraph.Alignment` per model into ``A``'s basis (None for the anchor, and for
    every model without alignment, whose shapes must then be the anchor's)."""
    alignments: list = []
    bar = progress_bar(models, desc=f"aligning (align={align})", unit="model", enabled=progress and align is not None)
    for i, m in enumerate(bar):
        al = None
        if i != anchor and align is not None:  # unaligned, the engine refuses other shapes
            al = align_models(A, m, inputs, data=data if align == "activations" or align_options.get("refine")
                              else None, report_a=ra, **align_options)
        alignments.append(al)
    return alignments


def _from_config(config, models, data, given: dict, align_options: dict) -> dict:
    """:func:`merge`'s keywords from a ``MergeConfig``, refused in one line when a keyword
    (``given``, ``align_options``) sets an option the config sets too."""
    import inspect
    default = {k: p.default for k, p in inspect.signature(merge).parameters.items()}
    both = sorted(k for k, v in given.items()
                  if v is not default[k] and not (type(v) is type(default[k]) and v == default[k]))
    kw = dict(weights=config.weights, align=None if config.align == "none" else config.align, method=config.method,
              method_options=dict(config.parameters), anchor=config.anchor, repair=config.repair,
              attention=config.attention, untie=config.untie, refine=config.refine, fold_norms=config.fold_norms,
              outputs=config.outputs)
    kw.update(solver_options(config))
    both += sorted(set(kw) & set(align_options))
    if both:
        raise InputError(f"merge(config=...) takes its options from the config, and {both[0]}= sets one too; "
                         f"expected {both[0]} in the MergeConfig (or no config)")
    if len(config.models) != len(models):
        raise InputError(f"the config names {len(config.models)} models and merge() was given {len(models)}; "
                         "expected one config entry per model")
    if config.seen_rows:  # Theus et al. 2025: weight matching on the token rows the data holds
        kw["rows"] = analyze(models[0]).input_rows(data)
    return {**kw, **align_options}


def _device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _engine(models, how, align, anchor, w, data, repair, attention, align_options) -> StreamingMerge:
    """The merge engine over ``models`` in memory (:class:`ModelCheckpoint` s), on their
    device, without a memory budget."""
    needs = how.needs_data or repair or align == "activations"  # the engine checks the data is used
    return StreamingMerge([ModelCheckpoint(m, f"model {i}") for i, m in enumerate(models)], weights=w,
                          align=align, anchor=0 if anchor == "universe" else anchor,
                          fold_norms=align_options.get("fold_norms", True), outputs=align_options.get("outputs"),
                          data=data if needs else None, method=how, device=_device(models[0]), repair=repair,
                          attention=attention)


def _circuits_without_config(models, alignments, w, anchor, ra):
    """Circuit-space heads for a model whose config cannot state them: the parents' traced
    program widened (:func:`~symgraph.merging.circuits.circuit_merge`), in memory only."""
    parents = [m if al is None else al.apply(m) for m, al in zip(models, alignments)]
    parents = parents[anchor:anchor + 1] + parents[:anchor] + parents[anchor + 1:]
    ws = [w[anchor]] + [x for i, x in enumerate(w) if i != anchor]
    return circuit_merge(parents, ws, ra)  # the head classes do not depend on folding


def _check_arguments(models, how, align, data, weights, repair=False):
    """The alignment mode (None for no alignment) and the normalised mixing weights."""
    if len(models) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(models)}")
    if align not in ("weights", "activations", None, "none"):
        raise InputError(f"align must be 'weights', 'activations' or None, got {align!r}")
    align = None if align == "none" else align
    if (how.needs_data or align == "activations") and data is None:
        raise InputError(f"method={how.name!r} with align={align!r} needs data (an iterable of batches)")
    if repair and data is None:
        raise InputError("repair=True needs data (an iterable of batches to measure activations on)")
    w = mixing_weights(weights, len(models))
    if data is not None and len(data) == 0:
        raise InputError("data is empty; expected at least one batch")
    for i, m in enumerate(models):
        check_finite(m, f"model {i}")
    return align, w


def _check_anchor(anchor, n, align, universe_options=None):
    """The anchor as an index in ``range(n)``, or "universe" (which needs an alignment)."""
    if universe_options is not None and anchor != "universe":
        raise InputError(f"universe_options={universe_options!r} apply only with "
                         f"anchor='universe', not anchor={anchor!r}")
    if isinstance(anchor, str):
        if anchor != "universe":
            raise InputError(f"anchor={anchor!r}; expected a model index (0..{n - 1}) or "
                             "'universe' (align every model to the mean of the others)")
        if align is None:
            raise InputError("anchor='universe' aligns the models to each other and needs "
                             "align='weights' or 'activations', not align=None")
        return anchor
    if isinstance(anchor, bool) or not isinstance(anchor, (int, np.integer)) or not -n <= anchor < n:
        raise InputError(f"anchor={anchor!r}; expected a model index (0..{n - 1}) or 'universe'")
    return int(anchor) % n


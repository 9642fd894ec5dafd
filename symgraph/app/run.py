"""The one merge entry: :func:`run_merge` takes a :class:`~symgraph.app.config.MergeConfig`
and runs it as its steps: the inputs checked before any work
(:class:`~symgraph.checkpoints.inputs.Inputs`: the output directory, the headers, the data
file), the engine built over the checkpoints, the merge aligned, written atomically, and
recorded beside it (``symgraph_merge.json`` and the model card, :mod:`.record`). Out of core is
every merge of local checkpoints (each method, aligned by weights, by activations or not at
all, REPAIR, learned matching, circuit-space heads, untying and full groups included); in
memory are demo names and hub ids, checkpoints whose tensor names only ``from_pretrained``
converts, and graphs the engine cannot run without weights. The ``symgraph merge`` command and
:func:`symgraph.merge_checkpoints` both call it."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..checkpoints.inputs import DEFAULT_SHARD, Inputs, read_batches
from ..core.progress import bar as progress_bar, note
from ..core.schema import UNSET
from ..core.finite import require_list
from ..core.ties import to_device
from ..errors import InputError, NeedsMemory, StructureMismatchError
from .config import MergeConfig, build_config
from ..checkpoints.specs import with_config_diff
from .record import card, record
from ..merging.streaming import StreamingMerge

if TYPE_CHECKING:
    from ..merging.driver import MergeResult

__all__ = ["run_merge", "merge_checkpoints", "MergeOutcome", "Merged"]


@dataclass
class MergeOutcome:
    """What :func:`run_merge` wrote: the directory, the path taken (``"streaming"`` or
    ``"in-memory"``), the number of models, the record written beside the model, and the
    out-of-core job (its ``alignments`` and ``timings``) or the in-memory
    :class:`~symgraph.merging.driver.MergeResult`."""
    out: str
    mode: str
    n_models: int
    meta: dict = field(default_factory=dict)
    job: StreamingMerge | MergeResult | None = None

    def summary(self, cfg: MergeConfig) -> str:
        how = (f"{cfg.method}, align={cfg.align}" + (f", refine={cfg.refine}" if cfg.refine else "")
               + (", shared universe" if cfg.anchor == "universe" else "") + (", repair" if cfg.repair else "")
               + (", circuit-space heads" if cfg.attention == "circuits" else "") + (", untied" if cfg.untie else ""))
        where = ", out of core" if self.mode == "streaming" else ""
        widths = self.meta.get("width_change")
        moved = f"; widths differ, transported into the anchor's ({'; '.join(widths)})" if widths else ""
        return f"merged {self.n_models} models ({how}{where}) into {self.out}{moved}"


def run_merge(cfg: MergeConfig, *, streaming: bool | None = None, data=None, anchor: int | None = None,
              progress: bool = True, **streaming_options) -> MergeOutcome:
    """Merge ``cfg.models`` into ``cfg.out``.

    ``streaming``: None chooses (out of core whenever the job allows it), True requires the
    out-of-core path (refused, saying why, when the job needs models in memory), False
    forces loading the models. ``data``: batches already loaded (else ``cfg.data`` is read).
    ``anchor`` (kept for callers: ``cfg.anchor``'s value, which it replaces) and
    ``streaming_options`` (``max_shard_size``, ``cache_bytes``) reach the out-of-core job. With
    ``cfg.anchor == "universe"`` every model is aligned into a shared universe
    (:mod:`symgraph.merging.universe`, out of core or in memory) and the merge has the
    first model's architecture. The steps: the inputs checked, the merge done out of core or
    in memory (:class:`Merged`), then recorded and written (:func:`_written`)."""
    if anchor is not None and anchor != cfg.anchor:
        cfg = build_config({**cfg.model_dump(), "anchor": anchor}, batches=data is not None)
    options, unused = dict(streaming_options), _unused_data(cfg)
    inputs = Inputs.check(cfg.models, cfg.out, force=cfg.force, data=cfg.data,
                          anchor=0 if cfg.anchor == "universe" else cfg.anchor,  # whose architecture the merge has
                          max_shard_size=options.pop("max_shard_size", cfg.max_shard_size))
    if unused:  # said once the inputs are checked (a refusal is the one line on stderr)
        note(unused, "warning")
        cfg = cfg.model_copy(update={"data": None})  # the record and the card then say data: null
    merged = _merge(cfg, inputs, data, progress, options, streaming)
    return _written(cfg, inputs, merged)


@dataclass
class Merged:
    """A merge done, not yet written: what the record says of it (``facts``, the keywords of
    :func:`~symgraph.app.record.record`, REPAIR's report among them), ``write(directory)`` writing
    its checkpoint there, the tokenizer's source, and the engine or the in-memory result
    (:attr:`MergeOutcome.job`); ``close()`` frees what the writing would read."""
    facts: dict
    write: Callable
    tokenizer_from: str | None
    n_models: int
    job: StreamingMerge | MergeResult
    close: Callable = lambda: None


def _unused_data(cfg) -> str | None:
    """The warning that ``cfg.data`` is used by no step of the merge (it is then dropped), or
    None."""
    if not cfg.data or cfg.takes_statistics or cfg.seen_rows:
        return None
    return (f"--data {cfg.data!r} is used by no step of this merge (--align {cfg.align}, "
            f"method {cfg.method}, no --repair, --refine or --seen-rows); the merge goes on without it")


def _merge(cfg, inputs, data, progress, options, streaming) -> Merged:
    """The merge done, not yet written: out of core where the job allows it (``streaming``
    None; refused, saying why, where True requires it), else with the models loaded (every
    reason to load them is found before the output is in place)."""
    job, batches, why = (None, None, None) if streaming is False else _engine(cfg, inputs, data, progress, options)
    if job is None and streaming:
        raise InputError(f"this merge cannot run out of core: {why}; expected a merge of local checkpoint "
                         "directories")
    if job is not None:
        try:
            return _merge_streaming(job, cfg, inputs, batches)
        except NeedsMemory as e:  # found while aligning or preparing, before the output is in place
            if streaming:
                raise InputError(f"this merge cannot run out of core: {e}; expected a merge the "
                                 "out-of-core path can run, or streaming=None to load the models") from None
            note(f"{e}, so the models are loaded in memory for this merge")
    return _merge_in_memory(cfg, inputs, data, progress, why if streaming is None else None)


def _engine(cfg, inputs, data, progress, options) -> tuple:
    """``(job, batches, None)``: the out-of-core engine over the checkpoints and the batches it
    reads (the method's statistics, REPAIR's, activation or learned matching's; the tokens
    ``seen_rows`` reads are its option), or ``(None, None, why)`` when the merge needs its
    models in memory."""
    why = ("the shared universe out of core takes no untying"
           if cfg.anchor == "universe" and cfg.untie
           else None if inputs.local else "not every model is a local checkpoint directory")
    ckpts = inputs.open(cfg.models) if why is None else None
    if ckpts is None:
        return None, None, why or "its tensor names are converted by from_pretrained"
    if (cfg.takes_statistics or cfg.seen_rows) and data is None:
        data = read_batches(cfg.data, ckpts[0].model, statistics=cfg.takes_statistics)
    if cfg.seen_rows:
        options["rows_from"] = data
    options["scratch"] = os.path.dirname(inputs.out)  # a universe's means, the statistics' spill: beside the output
    engine = cfg.model_copy(update={"out": None})
    batches = data if cfg.takes_statistics else None
    return StreamingMerge(ckpts, engine, data=batches, progress=progress, **options), batches, None


def _merge_streaming(job, cfg, inputs, data) -> Merged:
    """Out of core: the alignment solved from tensors read on demand (or rounds of a shared
    universe, their means written beside the output), the statistics and REPAIR taken; the
    merge is written shard by shard."""
    t0 = time.time()
    try:
        job.prepare()  # aligned (a universe's rounds), statistics (spilled beside the output), REPAIR
    except (StructureMismatchError, InputError) as e:
        raise with_config_diff(e, job.checkpoints, cfg.models) from None
    ckpts, anchor = job.checkpoints, job.checkpoints[job.anchor]
    facts = dict(data=data, mode="streaming", seconds=time.time() - t0, alignments=job.alignments,
                 dtype=anchor.dtype, input_dtypes=[c.dtype for c in ckpts], configs=[c.config for c in ckpts],
                 parent=(anchor.source or anchor).model, merged=job.output_model(), anchor=job.anchor,
                 universe=job.universe, repair=job.repair_report)  # the models on meta

    def write(directory):
        info = job.write(directory, inputs.shard)
        for c in ckpts:  # no input changed under the run, up to its end
            getattr(c, "check_unchanged", lambda: None)()
        return info
    return Merged(facts, write, anchor.path, len(ckpts), job, job.close)


def _merge_in_memory(cfg, inputs, data, progress, why=None) -> Merged:
    """The models loaded (on ``cfg.device``) and merged by :func:`symgraph.merge`; ``why``: the
    reason the engine could not run it out of core, said once the job is checked."""
    from ..checkpoints.specs import as_stored, load_model
    models = [to_device(load_model(m), cfg.device)
              for m in progress_bar(cfg.models, enabled=progress, desc="loading", unit="model")]
    if cfg.attention == "circuits":  # a model whose saved config could not state their size: refused
        from ..width.heads import check_config
        check_config(models[0], len(models))
    if data is None:
        data = read_batches(cfg.data, models[0], statistics=cfg.takes_statistics)
    if why:
        note(f"the models are loaded in memory for this merge: {why}")
    t0 = time.time()
    result = _merged(cfg, models, data, progress)
    layout = inputs.layouts[inputs.anchor]
    if layout is not None:  # the anchor's headers (None: a demo name or hub id)
        as_stored(result.model, layout)
    facts = dict(data=data, mode="in-memory", seconds=time.time() - t0, alignments=result.alignments,
                 dtype=next(result.model.parameters()).dtype, input_dtypes=[next(m.parameters()).dtype for m in models],
                 configs=[getattr(m, "config", None) for m in models], parent=models[0], merged=result.model,
                 anchor=inputs.anchor, universe=result.universe, repair=result.repair)
    first = os.path.expanduser(cfg.models[0])

    def write(directory):
        with progress_bar(total=1, enabled=progress, desc="writing") as bar:
            result.model.save_pretrained(directory, safe_serialization=True, max_shard_size=inputs.shard)
            bar.update()
    return Merged(facts, write, first if os.path.isdir(first) else None, len(models), result)



def _merged(cfg, models, data, progress):
    """:func:`symgraph.merge` of the loaded ``models`` on ``cfg.device`` (every option from
    the one config), checked finite and back on the CPU (safetensors reads host memory)."""
    from ..alignment.checks import check_finite
    from ..merging.driver import merge
    if data and cfg.device != "cpu":
        data = [{k: v.to(cfg.device) if hasattr(v, "to") else v for k, v in b.items()} for b in data]
    try:
        result = merge(models, data=data, progress=progress, config=cfg)
    except (StructureMismatchError, InputError) as e:
        raise with_config_diff(e, models, cfg.models) from None
    check_finite(result.model, "the merged model")
    if cfg.device != "cpu":
        result.model.to("cpu")
    return result


def _written(cfg, inputs, merged: Merged) -> MergeOutcome:
    """The ``merged`` model written into ``inputs.out`` atomically, with its record, its card and
    the first model's tokenizer files; the same on both paths."""
    from ..checkpoints.outdir import save_atomic
    try:
        meta = record(cfg, names=inputs.names, **merged.facts)
        text = card(cfg, inputs.out, meta)
        save_atomic(merged.write, inputs.out, force=cfg.force, inputs=inputs.files, meta=meta,
                    tokenizer_from=merged.tokenizer_from, card=text)
    finally:
        merged.close()
    return MergeOutcome(inputs.out, merged.facts["mode"], merged.n_models, meta, merged.job)


def merge_checkpoints(paths, out: str, *, weights=None, align=UNSET, anchor: int | str = 0, force: bool = False,
                      fold_norms: bool = True, max_shard_size=DEFAULT_SHARD, progress: bool = False,
                      data=None, outputs=None, **options) -> StreamingMerge:
    """Merge ``save_pretrained`` checkpoints into ``out`` without loading any model whole
    (see the module docstring), through the one merge entry
    (:func:`symgraph.app.run.run_merge`): ``out`` is vetted before any work and written
    atomically with its record and model card; ``align="activations"`` with ``data=`` batches
    aligns by activation statistics, still out of core (``align`` left unset: "weights", or
    "activations" with ``refine``, which refuses another given); other keywords that are
    :class:`~symgraph.app.config.MergeConfig` fields (``method``, ``parameters``, ``repair``,
    ``memory_budget``, ...) complete its config, checked whole as the command line's is, and the
    rest reach the engine. Returns the :class:`StreamingMerge` (``alignments``, ``timings``)."""
    require_list(paths, "paths", "a list of at least two checkpoint directories", (os.PathLike,))
    if not isinstance(out, (str, os.PathLike)):
        raise InputError(f"out={out!r}; expected the output directory's path")
    fields = {k: options.pop(k) for k in list(options) if k in MergeConfig.model_fields}  # method=, repair=, ...
    given = {} if align is UNSET else {"align": "none" if align is None else align}  # unset: the config's default
    cfg = build_config(dict(models=[str(p) for p in paths], out=str(out), weights=weights, force=force,
                            fold_norms=fold_norms, outputs=outputs, anchor=anchor, **given, **fields),
                       batches=data is not None, name=str)  # refusals name the keywords
    job = run_merge(cfg, streaming=True, data=data, progress=progress,
                    max_shard_size=max_shard_size, **options).job
    assert isinstance(job, StreamingMerge)  # streaming=True runs out of core or raises
    return job

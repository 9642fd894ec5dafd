"""The one merge entry: :func:`run_merge` takes a :class:`~symgraph.app.config.MergeConfig`,
vets the output directory before any work, chooses the out-of-core path (every merge of
local checkpoints: each method, aligned by weights, by activations or not at all, REPAIR,
learned matching, circuit-space heads, untying and full groups included) or the in-memory one
(demo names and hub ids, checkpoints whose tensor names only ``from_pretrained`` converts,
and graphs the engine cannot run without weights), and writes the merge
atomically with its record (``symgraph_merge.json``) and model card. The ``symgraph merge``
command and :func:`symgraph.merge_checkpoints` both call it."""
from __future__ import annotations

import os
import sys
import time
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._version import __version__
from ..core.ties import to_device
from ..errors import InputError, NeedsMemory, StructureMismatchError
from ..checkpoints.sharded import KeysDiffer
from .config import MergeConfig, build_config, to_yaml
from .compat import check_compatible, check_same_family, config_diff, width_change
from ..merging.methods.registry import get as get_method
from ..merging.streaming import DEFAULT_SHARD as _DEFAULT_SHARD, Checkpoint, StreamingMerge

if TYPE_CHECKING:
    from ..merging.driver import MergeResult

__all__ = ["run_merge", "merge_checkpoints", "MergeOutcome", "MIN_USEFUL_ROWS"]

MIN_USEFUL_ROWS = 32  # fewer data rows than this: warn that activation statistics are noisy


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
        how = (f"{cfg.method}, align={cfg.align}" + (", repair" if cfg.repair else "")
               + (", circuit-space heads" if cfg.attention == "circuits" else "") + (", untied" if cfg.untie else ""))
        where = ", out of core" if self.mode == "streaming" else ""
        widths = self.meta.get("width_change")
        moved = f"; widths differ, transported into the anchor's ({'; '.join(widths)})" if widths else ""
        return f"merged {self.n_models} models ({how}{where}) into {self.out}{moved}"


def progress_bar(iterable=None, *, enabled: bool = True, **kw):
    """tqdm on stderr (disabled: a plain pass-through; see :mod:`symgraph.core.progress`)."""
    from ..core.progress import bar
    return bar(iterable, enabled=enabled, **kw)


def run_merge(cfg: MergeConfig, *, streaming: bool | None = None, data=None, anchor: int | None = None,
              progress: bool = True, **streaming_options) -> MergeOutcome:
    """Merge ``cfg.models`` into ``cfg.out``.

    ``streaming``: None chooses (out of core whenever the job allows it), True requires the
    out-of-core path (refused, saying why, when the job needs models in memory), False
    forces loading the models. ``data``: batches already loaded (else ``cfg.data`` is read).
    ``anchor`` (kept for callers: ``cfg.anchor``'s value, which it replaces) and
    ``streaming_options`` (``max_shard_size``, ``cache_bytes``) reach the out-of-core job. With
    ``cfg.anchor == "universe"`` every model is aligned into a shared universe
    (:mod:`.universe_stream` out of core, :mod:`.universe` in memory) and the merge has the
    first model's architecture."""
    if anchor is not None and anchor != cfg.anchor:
        cfg = build_config({**cfg.model_dump(), "anchor": anchor}, batches=data is not None)
    anchor = 0 if cfg.anchor == "universe" else cfg.anchor  # the model whose architecture the merge has
    from ..checkpoints.outdir import check_out, check_space
    if not cfg.out:
        raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")
    inputs = list(cfg.models) + ([cfg.data] if cfg.data else [])
    out = check_out(cfg.out, force=cfg.force, inputs=inputs)  # before any work
    check_paths(cfg.models)
    layouts = local_layouts(cfg.models)  # the headers, read once for both paths
    check_dtype_kinds(layouts, cfg.models)
    if 0 <= anchor < len(layouts) and layouts[anchor] is not None:  # room for the anchor's tensors, before any work
        check_space(out, layouts[anchor].nbytes)
    if cfg.data:
        from ..checkpoints.specs import DATA_EXPECTED
        from ..core.files import check_input_file
        check_input_file(cfg.data, "data file", DATA_EXPECTED)
        cfg = _without_unused_data(cfg)
    if "max_shard_size" not in streaming_options:
        streaming_options = {**streaming_options, "max_shard_size": _shard_size(cfg, layouts[anchor])}
    job = None
    if streaming is not False:
        why = _needs_memory(cfg)
        if why is None:
            job = _streaming_job(cfg, layouts, data, anchor, progress, streaming_options)
            why = None if job is not None else "its tensor names are converted by from_pretrained"
        if job is None and streaming:
            raise InputError(f"this merge cannot run out of core: {why}; expected a merge of local "
                             "checkpoint directories")
    if job is not None:
        try:
            return _merge_streaming(job, cfg, out, inputs)
        except NeedsMemory as e:  # found while aligning, before anything is written
            if streaming:
                raise InputError(f"this merge cannot run out of core: {e}; expected a merge the "
                                 "out-of-core path can run, or streaming=None to load the models") from None
            print(f"symgraph: note: {e}, so the models are loaded in memory for this merge", file=sys.stderr)
    return _merge_in_memory(cfg, layouts[anchor], out, inputs, data, anchor, progress,
                            why if streaming is None else None, streaming_options["max_shard_size"])


def _without_unused_data(cfg):
    """``cfg``, its ``data`` dropped with a one-line warning when no step of the merge reads it
    (the record and the card then say ``data: null``)."""
    if cfg.align == "activations" or cfg.repair or cfg.refine or cfg.seen_rows or get_method(cfg.method).needs_data:
        return cfg
    print(f"symgraph: warning: --data {cfg.data!r} is used by no step of this merge (--align {cfg.align}, "
          f"method {cfg.method}, no --repair, --refine or --seen-rows); the merge goes on without it",
          file=sys.stderr)
    return cfg.model_copy(update={"data": None})


def _shard_size(cfg, layout) -> int:
    """Bytes per output file: ``cfg.max_shard_size``, else a sharded anchor's largest shard (the
    output sharded like the input), else the default."""
    from ..checkpoints.sharded import parse_size
    if cfg.max_shard_size:
        return parse_size(cfg.max_shard_size)
    files = set(layout.files.values()) if layout is not None else ()
    return max(os.path.getsize(f) for f in files) if len(files) > 1 else _DEFAULT_SHARD


def _card_yaml(cfg, out: str) -> str:
    """The config that reproduces the merge wherever it is run: the inputs and ``out`` as
    absolute paths (a config's relative paths are relative to the config file)."""
    data = os.path.abspath(cfg.data) if cfg.data else None
    return to_yaml(cfg.model_copy(update={"models": input_names(cfg.models), "data": data}), out)


def _needs_memory(cfg) -> str | None:
    """Why the job needs its models in memory, or None (the merge engine runs it out of core)."""
    if cfg.anchor == "universe" and (cfg.refine or cfg.untie):
        return "the shared universe out of core takes no learned matching or untying"
    local = [m for m in cfg.models if os.path.isdir(os.path.expanduser(m))]
    if len(local) != len(cfg.models):
        return "not every model is a local checkpoint directory"
    return None


def _merge_in_memory(cfg, layout, out, inputs, data, anchor, progress, why=None,
                     shard=_DEFAULT_SHARD) -> MergeOutcome:
    """The models loaded (on ``cfg.device``) and merged by :func:`symgraph.merge`; ``why``: the
    reason the engine could not run it out of core, said once the job is checked."""
    from ..alignment.checks import check_finite
    from ..checkpoints.outdir import model_card, save_atomic
    from ..checkpoints.specs import load_model
    from ..merging.driver import merge
    models = [to_device(load_model(m), cfg.device)
              for m in progress_bar(cfg.models, enabled=progress, desc="loading", unit="model")]
    check_same_family(models, cfg.models)
    check_compatible([getattr(m, "config", None) for m in models], cfg.models)
    if cfg.attention == "circuits":
        from ..merging.circuits import why_no_config
        why = why_no_config(models[0], len(models))
        if why:
            raise InputError(f"{why} (symgraph.merge(..., attention='circuits') in Python); expected a config "
                             "with head_dim (LLaMA, Qwen2, Mistral, Gemma...) for a saved checkpoint")
    data = data if data is not None else _data(cfg, models[0])
    if why:
        print(f"symgraph: note: the models are loaded in memory for this merge: {why}", file=sys.stderr)
    if data and cfg.device != "cpu":
        data = [{k: v.to(cfg.device) if hasattr(v, "to") else v for k, v in b.items()} for b in data]
    t0 = time.time()
    try:
        result = merge(models, data=data, progress=progress, config=cfg)  # every option from the one config
    except (StructureMismatchError, InputError) as e:
        raise type(e)(f"{e}{config_diff(models, cfg.models)}") from None
    check_finite(result.model, "the merged model")
    if cfg.device != "cpu":
        result.model.to("cpu")  # written from the CPU (safetensors reads host memory)
    if layout is not None:  # the anchor's headers (None: a demo name or hub id)
        _as_stored(result.model, layout)
    meta = _meta(cfg, data, mode="in-memory", seconds=time.time() - t0, alignments=result.alignments,
                 dtype=next(result.model.parameters()).dtype,
                 repair=result.repair.to_dict() if result.repair is not None else None,
                 input_dtypes=[next(m.parameters()).dtype for m in models])
    meta["architecture"] = _architecture_change(models[0], result.model)
    meta["width_change"] = width_change([getattr(m, "config", None) for m in models], cfg.models, anchor)
    meta["universe"] = result.universe  # the shared universe's rounds (None: an anchor)
    first = os.path.expanduser(cfg.models[0])
    with progress_bar(total=1, enabled=progress, desc="writing") as bar:
        model: typing.Any = result.model  # a transformers model (save_pretrained)
        save_atomic(lambda d: model.save_pretrained(d, safe_serialization=True, max_shard_size=shard),
                    out, force=cfg.force, inputs=inputs, meta=meta,
                    tokenizer_from=first if os.path.isdir(first) else None,
                    card=model_card(_card_yaml(cfg, out), _card_summary(meta)))
        bar.update()
    return MergeOutcome(out, "in-memory", len(models), meta, result)


def _streaming_job(cfg, layouts, data, anchor, progress, options):
    """A :class:`~symgraph.merging.streaming.StreamingMerge` for the job, or None when
    transformers would rename the checkpoints' tensors on load (only from_pretrained can)."""
    try:
        ckpts = [Checkpoint(os.path.expanduser(m), layout) for m, layout in zip(cfg.models, layouts)]
    except KeysDiffer:
        return None
    check_compatible([c.config for c in ckpts], cfg.models)
    stats = get_method(cfg.method).needs_data or cfg.repair  # statistics on the data (the method's, REPAIR's)
    align = "activations" if cfg.refine else cfg.align  # learned matching starts from activations, as in memory
    if (align == "activations" or cfg.seen_rows or stats) and data is None:
        data = _data(cfg, ckpts[0].model)
    if cfg.seen_rows:
        options = {**options, "rows_from": data}
    options = dict(options)
    shard = options.pop("max_shard_size", None)  # the input's shard size when the config sets none
    sizes = {} if shard is None else {"max_shard_size": shard if isinstance(shard, str) else f"{shard}B"}
    engine = cfg.model_copy(update={"align": align, "out": None, **sizes})
    try:
        return StreamingMerge(ckpts, engine, data=data if align == "activations" or stats else None,
                              progress=progress, **options)
    except InputError as e:
        raise type(e)(f"{e}{config_diff(ckpts, cfg.models)}") from None


def _merge_streaming(job, cfg, out, inputs) -> MergeOutcome:
    """Out of core: headers checked, alignment solved from tensors read on demand, the merge
    written shard by shard."""
    from ..checkpoints.outdir import model_card, save_atomic
    t0 = time.time()
    universe = None
    try:
        if cfg.anchor == "universe":  # rounds of engine plans, their means written beside the output
            from ..merging.universe_stream import align_universe_streamed
            universe = align_universe_streamed(job, os.path.dirname(out))
        else:
            job.align()
    except (StructureMismatchError, InputError) as e:
        raise type(e)(f"{e}{config_diff(job.ckpts, cfg.models)}") from None
    anchor = job.ckpts[job.anchor]
    meta = _meta(cfg, job.data, mode="streaming", seconds=time.time() - t0, alignments=job.alignments,
                 dtype=anchor.dtype, repair=None, input_dtypes=[c.dtype for c in job.ckpts])
    merged = job.transforms.circuits.built()[2] if job.transforms.circuits is not None else anchor.model  # meta models, no tensors
    meta["architecture"] = _architecture_change((anchor.source or anchor).model, merged)
    meta["width_change"] = width_change([c.config for c in job.ckpts], cfg.models, job.anchor)
    meta["universe"] = universe

    def write(directory):  # the record's REPAIR entry and the card once the merge is measured
        info = job.write(directory)
        for c in job.ckpts:  # no input changed under the run, up to its end
            getattr(c, "check_unchanged", lambda: None)()
        meta["repair"] = job.repair_report.to_dict() if job.repair_report is not None else None
        return info

    save_atomic(write, out, force=cfg.force, inputs=inputs, meta=meta, tokenizer_from=anchor.path,
                card=lambda: model_card(_card_yaml(cfg, out), _card_summary(meta)))
    return MergeOutcome(out, "streaming", len(job.ckpts), meta, job)


def _meta(cfg, data, *, mode, seconds, alignments, dtype, repair, input_dtypes=()) -> dict:
    """The record ``symgraph_merge.json`` holds (the same keys on both paths)."""
    options = cfg.model_dump(exclude={"models", "out", "force"})
    options["parameters"] = get_method(cfg.method, **cfg.parameters).params.model_dump()  # defaults too
    options["data"] = os.path.abspath(cfg.data) if cfg.data and data else None
    options["data_batches"] = len(data) if data else 0
    return {"symgraph_version": __version__, "inputs": input_names(cfg.models), "options": options,
            "dtype": str(dtype).removeprefix("torch."), "mode": mode, "seconds": seconds,
            "alignments": _solver_summary(alignments), "repair": repair,
            "input_dtypes": [str(d).removeprefix("torch.") for d in input_dtypes]}


def _architecture_change(parent, merged) -> list:
    """What the merged model changes of the parents' architecture (circuit-space heads, an
    untied head), each as one sentence; empty when it has the parents' architecture."""
    changes = []
    pc, mc = getattr(parent, "config", None), getattr(merged, "config", None)
    if pc is not None and mc is not None:
        if getattr(pc, "head_dim", None) != getattr(mc, "head_dim", None):
            changes.append(f"attention heads are {mc.head_dim} wide instead of {pc.head_dim} (circuit space: each "
                           "head interpolates the parents' QK and OV forms; 2x the attention parameters per "
                           "model merged)")
        if getattr(pc, "tie_word_embeddings", False) and not getattr(mc, "tie_word_embeddings", False):
            extra = sum(p.numel() for p in merged.parameters()) - sum(p.numel() for p in parent.parameters())
            changes.append(f"the head is untied from the embedding: {extra} more parameters (one vocabulary x "
                           "width matrix)")
    return changes


def _data(cfg, model):
    """The ``cfg.data`` batches for ``model`` (None without), with a warning when they are few."""
    from ..checkpoints.specs import load_data
    data = load_data(cfg.data, model) if cfg.data else None
    rows = sum(next(iter(b.values())).shape[0] for b in data) if data else 0
    stats = cfg.align == "activations" or cfg.repair or cfg.refine or get_method(cfg.method).needs_data
    if data and rows < MIN_USEFUL_ROWS and stats:  # (--seen-rows alone only reads which tokens occur)
        print(f"symgraph: warning: only {rows} row{'s' if rows != 1 else ''} of data in {cfg.data!r}; statistics from fewer "
              f"than {MIN_USEFUL_ROWS} rows are noisy (the merge goes on)", file=sys.stderr)
    return data


def _solver_summary(alignments):
    out = []
    for i, al in enumerate(alignments):
        if al is None:
            continue
        groups = [{"group": gid, "objective": getattr(res, "objective", None),
                   "status": getattr(res, "status", None), "seconds": getattr(res, "seconds", None)}
                  for gid, res in sorted(getattr(al, "results", {}).items(), key=lambda kv: str(kv[0]))]
        out.append({"model": i, "similarity": getattr(al, "similarity", None), "groups": groups,
                    "seconds": dict(getattr(al, "seconds", {}) or {}),  # solver time, sweeps run
                    "refined": dict(getattr(al, "refined", {}) or {})})
    return out


def check_paths(specs):
    """Fail fast on a missing local path or a name that is none of a path, a demo name and an
    ``owner/name`` hub id, before loading anything (hub ids are tried when loading)."""
    from ..checkpoints.specs import check_checkpoint_dir, model_kind
    for m in specs:
        if model_kind(m) == "local":
            check_checkpoint_dir(os.path.expanduser(m))


def _as_stored(model, layout):
    """Each floating-point tensor of the merged ``model`` in the dtype the anchor's checkpoint
    stores it in (``from_pretrained`` loads every tensor in one dtype; the out-of-core path
    writes each in its own): the dtypes follow the tensors, not the config."""
    import torch
    with torch.no_grad():
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            want = layout.dtypes.get(name)
            if want is not None and want.is_floating_point and t.is_floating_point() and t.dtype != want:
                t.data = t.data.to(want)


def local_layouts(specs) -> list:
    """The :class:`~symgraph.checkpoints.loading.Layout` of each local checkpoint directory
    (None for a demo name or hub id): the one reading of its headers every path starts from."""
    from ..checkpoints.loading import read_layout
    return [read_layout(os.path.expanduser(m)) if os.path.isdir(os.path.expanduser(m)) else None for m in specs]


def check_dtype_kinds(layouts, names):
    """Refuse, before any work, a tensor stored as a floating-point number in one model and as
    an integer in another (no merge can say what it should be), naming it."""
    first = next((i for i, lay in enumerate(layouts) if lay is not None), None)
    if first is None:
        return
    base = layouts[first]
    for name, lay in zip(names, layouts):
        if lay is None or lay is base:
            continue
        for k in base.keys:
            a, b = base.dtypes[k], lay.dtypes.get(k)
            if b is not None and a.is_floating_point != b.is_floating_point:
                raise InputError(f"tensor {k!r} is {str(a).removeprefix('torch.')} in {names[first]!r} but "
                                 f"{str(b).removeprefix('torch.')} in {name!r}; expected the same kind of number "
                                 "(floating point or integer) in every model")


def input_names(specs) -> list:
    """What the output's metadata records as its inputs: absolute paths for local ones."""
    return [os.path.abspath(os.path.expanduser(m)) if os.path.exists(os.path.expanduser(m)) else m
            for m in specs]


def _card_summary(meta) -> str:
    lines = [f"symgraph {meta['symgraph_version']}, weights in {meta['dtype']}, {meta['seconds']:.1f} s."]
    for al in meta["alignments"]:
        by: dict[str, int] = {}
        for g in al["groups"]:
            by[g["status"]] = by.get(g["status"], 0) + 1
        stats = ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
        lines.append(f"- model {al['model']} aligned to model 0 from {al['similarity']}: "
                     f"{len(al['groups'])} symmetry groups solved ({stats}).")
    if not meta["alignments"]:
        lines.append("- no alignment (plain combination in each model's own basis).")
    lines += [f"- architecture change: {c}." for c in meta.get("architecture", [])]
    lines += [f"- width change: {c} (transported into the anchor's widths by the alignment)."
              for c in meta.get("width_change") or []]
    kinds = list(dict.fromkeys(meta.get("input_dtypes") or []))
    if len(kinds) > 1:
        lines.append(f"- the inputs are stored in {' and '.join(kinds)}: merged in float32 (or wider) and "
                     f"written in the anchor's {meta['dtype']}.")
    rep = meta.get("repair")
    if rep and rep["layers"]:
        n = len(rep["layers"])
        before = sum(x["before"] for x in rep["layers"]) / n
        after = sum(x["after"] for x in rep["layers"]) / n
        lines.append(f"- REPAIR: {n} layers renormalised to the inputs' interpolated activation "
                     f"statistics (mean |std/target - 1| {before:.3g} -> {after:.3g}).")
    if rep and rep.get("batchnorm"):
        lines.append(f"- REPAIR: BatchNorm running statistics of {len(rep['batchnorm'])} layers "
                     "recomputed on the data for the merged model.")
    return "\n".join(lines)


def merge_checkpoints(paths, out: str, *, weights=None, align="weights", anchor: int | str = 0, force: bool = False,
                      fold_norms: bool = True, max_shard_size=_DEFAULT_SHARD, progress: bool = False,
                      data=None, outputs=None, **options) -> StreamingMerge:
    """Merge ``save_pretrained`` checkpoints into ``out`` without loading any model whole
    (see the module docstring), through the one merge entry
    (:func:`symgraph.app.run.run_merge`): ``out`` is vetted before any work and written
    atomically with its record and model card; ``align="activations"`` with ``data=`` batches
    aligns by activation statistics, still out of core; other keywords that are
    :class:`~symgraph.app.config.MergeConfig` fields (``method``, ``parameters``, ``repair``,
    ``memory_budget``, ...) complete its config, checked whole as the command line's is, and the
    rest reach the engine. Returns the :class:`StreamingMerge` (``alignments``, ``timings``)."""
    fields = {k: options.pop(k) for k in list(options) if k in MergeConfig.model_fields}  # method=, repair=, ...
    cfg = build_config(dict(models=[str(p) for p in paths], out=str(out), weights=weights,
                            align="none" if align is None else align, force=force, fold_norms=fold_norms,
                            outputs=outputs, anchor=anchor, **fields), batches=data is not None)
    job = run_merge(cfg, streaming=True, data=data, progress=progress,
                    max_shard_size=max_shard_size, **options).job
    assert isinstance(job, StreamingMerge)  # streaming=True runs out of core or raises
    return job

"""``symgraph merge``: models or checkpoints in, one merged checkpoint out (the CLI's merge
command, its out-of-core path and the record it writes beside the model)."""
from __future__ import annotations

import os
import sys
import time

from .errors import InputError

MIN_USEFUL_ROWS = 32  # fewer data rows than this: warn that activation statistics are noisy


def _progress(iterable=None, **kw):
    from tqdm import tqdm
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=kw.pop("disable", None), **kw)


def _solver_summary(alignments):
    out = []
    for i, al in enumerate(alignments):
        if al is None:
            continue
        groups = []
        for gid, res in sorted(getattr(al, "results", {}).items(), key=lambda kv: str(kv[0])):
            groups.append({"group": gid, "objective": getattr(res, "objective", None),
                           "status": getattr(res, "status", None),
                           "seconds": getattr(res, "seconds", None)})
        out.append({"model": i, "similarity": getattr(al, "similarity", None), "groups": groups,
                    "refined": dict(getattr(al, "refined", {}) or {})})
    return out


def cmd_merge(args) -> int:
    from .alignment.checks import check_finite
    from .config import merge_options
    from .errors import StructureMismatchError
    from .io import load_model
    from .merging import merge
    from .output import check_out, model_card, save_atomic
    opts = merge_options(vars(args))
    inputs = list(opts["models"]) + ([opts["data"]] if opts["data"] else [])
    out = check_out(opts["out"], force=opts["force"], inputs=inputs)  # before any work
    _check_paths(opts["models"])
    if opts["data"] and not os.path.isfile(opts["data"]):
        raise FileNotFoundError(f"data file {opts['data']!r} does not exist; expected a .safetensors or "
                                ".pt file holding a tensor 'input_ids' [N, S] (or 'pixel_values')")
    job = _streaming_job(opts)
    if job is not None:
        return _merge_streaming(job, opts, out, inputs)
    models = [load_model(m) for m in _progress(opts["models"], desc="loading", unit="model")]
    _check_same_family(models, opts["models"])
    data = _data(opts, models[0])
    align = None if opts["align"] == "none" else opts["align"]
    t0 = time.time()
    try:
        result = merge(models, weights=opts["weights"], align=align, data=data, method=opts["method"],
                       repair=opts["repair"], progress=True, refine=opts["refine"],
                       fold_norms=opts["fold_norms"], outputs=opts["outputs"])
    except (StructureMismatchError, InputError) as e:
        raise type(e)(f"{e}{_config_diff(models, opts['models'])}") from None
    seconds = time.time() - t0
    check_finite(result.model, "the merged model")
    first = os.path.expanduser(opts["models"][0])
    meta = {"symgraph_version": _version(), "inputs": _input_names(opts["models"]),
            "options": _options_meta(opts, data),
            "dtype": str(next(result.model.parameters()).dtype).removeprefix("torch."),
            "mode": "in-memory", "seconds": seconds, "alignments": _solver_summary(result.alignments),
            "repair": result.repair.to_dict() if result.repair is not None else None}
    with _progress(total=1, desc="writing") as bar:
        save_atomic(result.model, out, force=opts["force"], inputs=inputs, meta=meta,
                    tokenizer_from=first if os.path.isdir(first) else None,
                    card=model_card(_config_yaml(meta), _card_summary(meta)))
        bar.update()
    print(f"merged {len(models)} models ({opts['method']}, align={opts['align']}"
          f"{', repair' if opts['repair'] else ''}) into {out}")
    return 0


def _data(opts, model):
    """The ``--data`` batches for ``model`` (None without), with a warning when they are few."""
    from .io import load_data
    data = load_data(opts["data"], model) if opts["data"] else None
    rows = sum(next(iter(b.values())).shape[0] for b in data) if data else 0
    if data and rows < MIN_USEFUL_ROWS:
        print(f"symgraph: warning: only {rows} rows of data in {opts['data']!r}; statistics from fewer "
              f"than {MIN_USEFUL_ROWS} rows are noisy (the merge goes on)", file=sys.stderr)
    return data


def _streaming_job(opts):
    """A :class:`~symgraph.streaming.StreamingMerge` when the merge needs no model in memory
    (a plain average aligned by weights, by activations or not at all, of local checkpoints
    whose tensor names are the model's), else None: the models are loaded."""
    if (opts["method"] != "average" or opts["repair"]
            or opts["refine"] or not all(os.path.isdir(os.path.expanduser(m)) for m in opts["models"])):
        return None
    from .streaming import Checkpoint, KeysDiffer, StreamingMerge
    try:
        ckpts = [Checkpoint(os.path.expanduser(m)) for m in opts["models"]]
    except KeysDiffer:  # transformers converts these names on load: only from_pretrained can
        return None
    data = _data(opts, ckpts[0].model) if opts["align"] == "activations" else None
    try:
        return StreamingMerge(ckpts, weights=opts["weights"], align=opts["align"], data=data,
                              fold_norms=opts["fold_norms"], outputs=opts["outputs"], progress=True)
    except InputError as e:
        raise type(e)(f"{e}{_config_diff(ckpts, opts['models'])}") from None


def _merge_streaming(job, opts, out, inputs) -> int:
    """``symgraph merge`` out of core: headers checked, alignment solved from tensors read on
    demand, the merge written shard by shard."""
    from .output import model_card, save_atomic
    from .errors import StructureMismatchError
    t0 = time.time()
    try:
        job.align()
    except (StructureMismatchError, InputError) as e:
        raise type(e)(f"{e}{_config_diff(job.ckpts, opts['models'])}") from None
    anchor = job.ckpts[job.anchor]
    meta = {"symgraph_version": _version(),
            "inputs": _input_names(opts["models"]),
            "options": _options_meta({**opts, "data": opts["data"] if job.data else None, "repair": False,
                                      "refine": 0}, job.data),
            "dtype": str(anchor.dtype).removeprefix("torch."), "mode": "streaming",
            "seconds": time.time() - t0, "alignments": _solver_summary(job.alignments), "repair": None}
    save_atomic(job.write, out, force=opts["force"], inputs=inputs, meta=meta, tokenizer_from=anchor.path,
                card=model_card(_config_yaml(meta), _card_summary(meta)))
    print(f"merged {len(job.ckpts)} models (average, align={opts['align']}, out of core) into {out}")
    return 0


def _options_meta(opts, data=None) -> dict:
    """The merge options ``symgraph_merge.json`` records (``data``: the batches read)."""
    return {"align": opts["align"], "method": opts["method"], "weights": opts["weights"],
            "data": os.path.abspath(opts["data"]) if opts["data"] else None,
            "data_batches": len(data) if data else 0, "repair": opts["repair"],
            "refine": opts["refine"], "fold_norms": opts["fold_norms"], "outputs": opts["outputs"]}


def _check_paths(specs):
    """Fail fast on a missing local path, before loading anything (a spec that is not a path
    is a demo name or hub id, tried when loading)."""
    from .io import check_checkpoint_dir
    for m in specs:
        p = os.path.expanduser(m)
        if os.path.exists(p) or m.startswith((".", "/", "~")) or m.count("/") > 1:
            check_checkpoint_dir(p)


def _input_names(specs) -> list:
    """What the output's metadata records as its inputs: absolute paths for local ones."""
    return [os.path.abspath(os.path.expanduser(m)) if os.path.exists(os.path.expanduser(m)) else m
            for m in specs]


def _check_same_family(models, names):
    """Refuse models of different classes before any work, naming them."""
    classes = [type(m).__name__ for m in models]
    for name, cls in zip(names[1:], classes[1:]):
        if cls != classes[0]:
            raise InputError(f"{names[0]!r} is a {classes[0]} but {name!r} is a {cls}; expected models of "
                             "one architecture")


def _config_diff(models, names) -> str:
    """``" (configs differ: num_hidden_layers 2 vs 3, ...)"`` or ``""``."""
    skip = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}
    cfgs = [getattr(m, "config", None) for m in models]
    if any(c is None for c in cfgs):
        return ""
    base = cfgs[0].to_dict()
    diffs = []
    for name, c in zip(names[1:], cfgs[1:]):
        d = c.to_dict()
        for k in sorted(set(base) | set(d)):
            if k not in skip and base.get(k) != d.get(k) and not isinstance(base.get(k), dict):
                diffs.append(f"{k} {base.get(k)!r} vs {d.get(k)!r}")
    return f" (configs differ: {', '.join(diffs[:6])}{' ...' if len(diffs) > 6 else ''})" if diffs else ""


def _config_yaml(meta) -> str:
    import yaml
    o = meta["options"]
    cfg = {"models": meta["inputs"], "align": o["align"], "method": o["method"]}
    if o["weights"] is not None:
        cfg["weights"] = o["weights"]
    if o["data"]:
        cfg["data"] = o["data"]
    if o.get("repair"):
        cfg["repair"] = True
    if o.get("refine"):
        cfg["refine"] = o["refine"]
    if o.get("fold_norms") is False:
        cfg["fold_norms"] = False
    cfg["out"] = "merged"
    return yaml.safe_dump(cfg, sort_keys=False)


def _card_summary(meta) -> str:
    lines = [f"symgraph {meta['symgraph_version']}, weights in {meta['dtype']}, "
             f"{meta['seconds']:.1f} s."]
    for al in meta["alignments"]:
        by = {}
        for g in al["groups"]:
            by[g["status"]] = by.get(g["status"], 0) + 1
        stats = ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
        lines.append(f"- model {al['model']} aligned to model 0 from {al['similarity']}: "
                     f"{len(al['groups'])} symmetry groups solved ({stats}).")
    if not meta["alignments"]:
        lines.append("- no alignment (plain combination in each model's own basis).")
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


def _version():
    from . import __version__
    return __version__

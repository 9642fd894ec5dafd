"""The ``symgraph`` command: ``analyze``, ``merge``, ``resize`` and ``demo``, thin over the library.

Every refusal is one paragraph on stderr (what was wrong, what was expected), exit code 2,
nothing written; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

from .errors import InputError

__all__ = ['main', 'build_parser']

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
MIN_USEFUL_ROWS = 32  # fewer data rows than this: warn that activation statistics are noisy



def _methods() -> tuple:
    from .merging import merge_methods
    return merge_methods()


class _Refusal(Exception):
    """A refusal raised by the CLI itself (bad options)."""


def _progress(iterable=None, **kw):
    from tqdm import tqdm
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=kw.pop("disable", None), **kw)


# --- analyze -------------------------------------------------------------------------------


def cmd_analyze(args) -> int:
    from . import analyze
    from .io import load_model
    for p in (args.dot, args.png):
        if p and not os.path.isdir(os.path.dirname(os.path.abspath(p))):
            raise FileNotFoundError(f"the directory of graph output {p!r} does not exist; expected an "
                                    "existing directory")
    if args.dot and not args.dot.lower().endswith(".dot"):
        raise _Refusal(f"--dot {args.dot!r} must end in .dot")
    if args.png and not args.png.lower().endswith((".png", ".svg")):
        raise _Refusal(f"--png {args.png!r} must end in .png (or .svg)")
    with _progress(total=2, desc="analyze") as bar:
        bar.set_postfix_str("loading")
        model = load_model(args.model)
        bar.update()
        bar.set_postfix_str("tracing")
        report = analyze(model, fold_norms=not args.no_fold_norms, outputs=args.outputs)
        bar.update()
    if args.json:
        print(report.to_json())
    else:
        print(report.summary())
    for p in (args.dot, args.png):
        if p:
            report.save_graph(p)
            if not args.json:
                print(f"wrote {p}")
    return 0


# --- merge ---------------------------------------------------------------------------------


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
    from .io import load_data, load_model
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
    data = load_data(opts["data"], models[0]) if opts["data"] else None
    rows = sum(next(iter(b.values())).shape[0] for b in data) if data else 0
    if data and rows < MIN_USEFUL_ROWS:
        print(f"symgraph: warning: only {rows} rows of data in {opts['data']!r}; statistics from fewer "
              f"than {MIN_USEFUL_ROWS} rows are noisy (the merge goes on)", file=sys.stderr)
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


def _streaming_job(opts):
    """A :class:`~symgraph.streaming.StreamingMerge` when the merge needs no model in memory
    (a plain average aligned by weights or not at all, of local checkpoints whose tensor names
    are the model's), else None: the models are loaded."""
    if (opts["method"] != "average" or opts["align"] == "activations" or opts["repair"]
            or opts["refine"] or not all(os.path.isdir(os.path.expanduser(m)) for m in opts["models"])):
        return None
    from .streaming import Checkpoint, KeysDiffer, StreamingMerge
    try:
        ckpts = [Checkpoint(os.path.expanduser(m)) for m in opts["models"]]
    except KeysDiffer:  # transformers converts these names on load: only from_pretrained can
        return None
    try:
        return StreamingMerge(ckpts, weights=opts["weights"], align=opts["align"],
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
            "options": _options_meta({**opts, "data": None, "repair": False, "refine": 0}),
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


# --- resize --------------------------------------------------------------------------------


def cmd_resize(args) -> int:
    from . import analyze
    from .io import load_model
    from .output import check_out, save_atomic
    from .resize import resize, same_role
    widths = {}
    for spec in args.width:
        ids, _, n = spec.partition("=")
        try:
            ids, n = [int(i) for i in ids.split(",")], int(n)
        except ValueError:
            raise _Refusal(f"--width {spec!r}: expected IDS=N (group ids from symgraph analyze, "
                           "comma-separated, and the new width), e.g. --width 5,10=96") from None
        widths.update({i: n for i in ids})
    out = check_out(args.out, force=args.force, inputs=[args.model])
    _check_paths([args.model])
    model = load_model(args.model)
    report = analyze(model)
    if args.every_layer:
        widths = same_role(report, widths)
    t0 = time.time()
    res = resize(model, widths, split=args.split, seed=args.seed, report=report)
    meta = {"symgraph_version": _version(), "inputs": _input_names([args.model]),
            "mode": "resize", "widths": res.widths, "config": res.config, "error": res.error,
            "split": args.split, "seed": args.seed, "seconds": time.time() - t0,
            "dtype": str(next(res.model.parameters()).dtype).removeprefix("torch.")}
    src = os.path.expanduser(args.model)
    save_atomic(res.model, out, force=args.force, inputs=[args.model], meta=meta,
                tokenizer_from=src if os.path.isdir(src) else None)
    sizes = ", ".join(f"{g}: {a} -> {b}" for g, (a, b) in sorted(res.widths.items()))
    cfg = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in res.config.items())
    print(f"resized classes {sizes}{f' ({cfg})' if cfg else ''}; relative output deviation "
          f"{res.error:.3g}; wrote {out}")
    return 0


# --- demo ----------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    from .demo import run_demo
    run_demo(out=args.out, seconds=args.seconds, force_retrain=args.retrain)
    return 0


# --- main ----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``symgraph merge: argument --refine: invalid int value``),
    exit 2; ``-h`` still prints the full usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} -h)\n")


def build_parser():
    p = _Parser(prog="symgraph", description="Graph-based symmetry compiler: analyse "
                "and merge neural networks.")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line refusals")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    a = sub.add_parser("analyze", help="report the weight-space symmetries of a model")
    a.add_argument("model", help="save_pretrained directory, demo name (tiny-bert, tiny-gpt2, "
                   "tiny-llama, tiny-vit) or hub id")
    a.add_argument("--json", action="store_true", help="print only the JSON report")
    a.add_argument("--no-fold-norms", action="store_true",
                   help="do not fold norm gains (residual streams stay permutations)")
    a.add_argument("--outputs", nargs="+", metavar="NAME", default=None,
                   help="the outputs a symmetry must keep (e.g. logits); default: all")
    a.add_argument("--dot", metavar="FILE", help="write the group graph as Graphviz .dot")
    a.add_argument("--png", metavar="FILE", help="write the group graph as .png (or .svg)")
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    a.set_defaults(func=cmd_analyze)

    m = sub.add_parser("merge", help="align and merge N models of one architecture")
    m.add_argument("models", nargs="*", help="two or more model directories / names")
    m.add_argument("--config", metavar="YAML", help="merge options from a YAML file")
    m.add_argument("--out", metavar="DIR", help="output directory (must not exist unless --force)")
    m.add_argument("--align", choices=("weights", "activations", "none"), default=None)
    m.add_argument("--method", choices=_methods(), default=None)
    m.add_argument("--weights", type=float, nargs="+", metavar="W", default=None)
    m.add_argument("--data", metavar="FILE", help=".safetensors/.pt with 'input_ids' [N, S]")
    m.add_argument("--repair", action="store_true", default=None,
                   help="REPAIR: renormalise the merge's hidden activations to the inputs' "
                   "interpolated mean and std (needs --data)")
    m.add_argument("--refine", type=int, metavar="N", default=None,
                   help="learned matching: N optimisation steps after activation matching, on "
                   "the model's own loss over --data")
    m.add_argument("--no-fold-norms", action="store_true", default=None,
                   help="keep residual streams permutations (do not fold norm gains)")
    m.add_argument("--outputs", nargs="+", metavar="NAME", default=None,
                   help="the outputs the alignment must keep (e.g. logits); default: all")
    m.add_argument("--force", action="store_true", help="replace an existing --out")
    m.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    m.set_defaults(func=cmd_merge)

    r = sub.add_parser("resize", help="widen (function-preserving) or shrink (compress) "
                       "permutation classes of a model")
    r.add_argument("model", help="save_pretrained directory, demo name or hub id")
    r.add_argument("--width", action="append", required=True, metavar="IDS=N",
                   help="new width N for the classes IDS (ids from symgraph analyze, e.g. 5,10=96)")
    r.add_argument("--every-layer", action="store_true",
                   help="also resize every class with the same role in the other layers")
    r.add_argument("--split", choices=("even", "random"), default="even",
                   help="how a widened unit's outgoing weights are shared by its copies")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", metavar="DIR", required=True, help="output directory (must not exist "
                   "unless --force)")
    r.add_argument("--force", action="store_true", help="replace an existing --out")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    r.set_defaults(func=cmd_resize)

    d = sub.add_parser("demo", help="train two tiny char-level GPT-2s and compare merges")
    d.add_argument("--out", metavar="DIR", default="symgraph-demo")
    d.add_argument("--seconds", type=float, default=None, help="training budget in seconds (total)")
    d.add_argument("--retrain", action="store_true", help="ignore the cached models")
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    d.set_defaults(func=cmd_demo)
    return p


def _refuse(msg: str) -> int:
    msg = " ".join(str(msg).split())
    print("symgraph: " + textwrap.fill(msg, width=100, subsequent_indent="  ",
                                       break_long_words=False, break_on_hyphens=False),
          file=sys.stderr)
    return EXIT_REFUSED


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    if debug:
        return args.func(args)
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from .errors import SymgraphError, TraceError
    from .output import Terminated, terminate_on_sigterm
    terminate_on_sigterm()
    try:
        return args.func(args)
    except TraceError as e:
        return _refuse(f"{e} Hint: symgraph traces the model with torch.export; models with "
                       "data-dependent control flow or unsupported ops cannot be traced. Run with "
                       "--debug for the full traceback.")
    except (SymgraphError, _Refusal, FileNotFoundError, ValueError, OSError) as e:
        return _refuse(str(e) if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        _refuse("interrupted (Ctrl-C); nothing was written")
        return EXIT_INTERRUPTED
    except Terminated:
        _refuse("terminated (SIGTERM); nothing was written")
        return EXIT_TERMINATED


if __name__ == "__main__":
    sys.exit(main())

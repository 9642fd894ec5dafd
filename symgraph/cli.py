"""The ``symgraph`` command: ``analyze``, ``merge`` and ``demo``, thin over the library.

Every refusal is one paragraph on stderr (what was wrong, what was expected), exit code 2,
nothing written; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

EXIT_REFUSED = 2

MERGE_KEYS = {
    "models": "a list of at least 2 model paths / names",
    "out": "an output directory path (string)",
    "align": "one of 'weights', 'activations', 'none'",
    "method": "a merge method name (symgraph.merge_methods())",
    "weights": "a list of numbers, one per model",
    "data": "a path to a .safetensors or .pt data file (string)",
    "force": "true or false",
}


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
        report = analyze(model)
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


def _read_config(path: str) -> dict:
    import yaml
    if not os.path.isfile(path):
        raise FileNotFoundError(f"merge config {path!r} does not exist; expected a YAML file with keys "
                                f"{', '.join(MERGE_KEYS)}")
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise _Refusal(f"merge config {path!r} is not valid YAML ({str(e).splitlines()[0]}); expected a "
                       f"mapping with keys {', '.join(MERGE_KEYS)}") from None
    if not isinstance(cfg, dict):
        raise _Refusal(f"merge config {path!r} holds a {type(cfg).__name__}; expected a mapping with keys "
                       f"{', '.join(MERGE_KEYS)}")
    for k in cfg:
        if k not in MERGE_KEYS:
            raise _Refusal(f"merge config {path!r} has an unknown key {k!r}; expected only "
                           f"{', '.join(MERGE_KEYS)}")
    base = os.path.dirname(os.path.abspath(path))

    def rel(p):  # paths in the config are relative to the config file
        p = os.path.expanduser(p)
        q = os.path.join(base, p)
        return q if not os.path.isabs(p) and os.path.exists(q) else p

    def bad(k, v):
        return _Refusal(f"merge config {path!r}: key {k!r} is {v!r} ({type(v).__name__}); expected "
                        f"{MERGE_KEYS[k]}")

    out = {}
    if "models" not in cfg:
        raise _Refusal(f"merge config {path!r} has no 'models' key; expected {MERGE_KEYS['models']}")
    ms = cfg["models"]
    if not isinstance(ms, list) or len(ms) < 2 or not all(isinstance(m, str) for m in ms):
        raise bad("models", ms)
    out["models"] = [rel(m) for m in ms]
    if "out" in cfg:
        if not isinstance(cfg["out"], str):
            raise bad("out", cfg["out"])
        o = os.path.expanduser(cfg["out"])
        out["out"] = o if os.path.isabs(o) else os.path.join(base, o)
    if "align" in cfg:
        a = cfg["align"]
        a = "none" if a is None or a is False else a
        if a not in ("weights", "activations", "none"):
            raise bad("align", cfg["align"])
        out["align"] = a
    if "method" in cfg:
        if cfg["method"] not in _methods():
            raise bad("method", cfg["method"])
        out["method"] = cfg["method"]
    if "weights" in cfg:
        w = cfg["weights"]
        if not isinstance(w, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in w):
            raise bad("weights", w)
        out["weights"] = [float(x) for x in w]
    if "data" in cfg:
        if not isinstance(cfg["data"], str):
            raise bad("data", cfg["data"])
        out["data"] = rel(cfg["data"])
    if "force" in cfg:
        if not isinstance(cfg["force"], bool):
            raise bad("force", cfg["force"])
        out["force"] = cfg["force"]
    return out


def _merge_options(args) -> dict:
    opts = {"models": [], "out": None, "align": "weights", "method": "average", "weights": None,
            "data": None, "force": False}
    if args.config:
        opts.update(_read_config(args.config))
    # command-line values override the config
    if args.models:
        if args.config and opts["models"]:
            raise _Refusal("models given both on the command line and in --config; expected one or the other")
        opts["models"] = list(args.models)
    for k in ("out", "align", "method", "weights", "data"):
        v = getattr(args, k)
        if v is not None:
            opts[k] = v
    if args.force:
        opts["force"] = True
    if len(opts["models"]) < 2:
        raise _Refusal(f"merge needs at least 2 models, got {len(opts['models'])}; expected "
                       "`symgraph merge A B [C ...] --out DIR` or `symgraph merge --config merge.yaml`")
    if not opts["out"]:
        raise _Refusal("merge needs an output directory; expected --out DIR (or 'out:' in the config)")
    if opts["weights"] is not None and len(opts["weights"]) != len(opts["models"]):
        raise _Refusal(f"--weights has {len(opts['weights'])} values for {len(opts['models'])} models; "
                       "expected one weight per model")
    if opts["weights"] is not None and (any(w < 0 for w in opts["weights"]) or sum(opts["weights"]) <= 0):
        raise _Refusal(f"--weights {opts['weights']} must be non-negative with a positive sum")
    needs_data = opts["method"] != "average" or opts["align"] == "activations"
    if needs_data and not opts["data"]:
        raise _Refusal(f"--align {opts['align']} with --method {opts['method']} needs --data FILE (a "
                       ".safetensors or .pt file with a tensor 'input_ids' [N, S]); expected --data, or "
                       "--align weights/none with --method average")
    return opts


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
        out.append({"model": i, "similarity": getattr(al, "similarity", None), "groups": groups})
    return out


def cmd_merge(args) -> int:
    from .alignment.checks import check_finite
    from .merging import merge
    from .io import check_checkpoint_dir, check_out, load_data, load_model, save_atomic
    opts = _merge_options(args)
    out = check_out(opts["out"], opts["force"])
    for m in opts["models"]:  # fail fast on a missing path, before loading anything
        p = os.path.expanduser(m)
        if os.path.exists(p) or m.startswith((".", "/", "~")) or m.count("/") > 1:
            check_checkpoint_dir(p)
    if opts["data"] and not os.path.isfile(opts["data"]):
        raise FileNotFoundError(f"data file {opts['data']!r} does not exist; expected a .safetensors or "
                                ".pt file holding a tensor 'input_ids' [N, S] (or 'pixel_values')")
    models = []
    for m in _progress(opts["models"], desc="loading", unit="model"):
        models.append(load_model(m))
    data = load_data(opts["data"], models[0]) if opts["data"] else None
    align = None if opts["align"] == "none" else opts["align"]
    t0 = time.time()
    with _progress(total=1, desc=f"merging ({opts['method']}, align={opts['align']})") as bar:
        result = merge(models, weights=opts["weights"], align=align, data=data, method=opts["method"])
        merged, alignments = result.model, result.alignments
        bar.update()
    seconds = time.time() - t0
    check_finite(merged, "the merged model")
    first = os.path.expanduser(opts["models"][0])
    meta = {"symgraph_version": _version(), "inputs": [os.path.abspath(os.path.expanduser(m))
                                                      if os.path.exists(os.path.expanduser(m)) else m
                                                      for m in opts["models"]],
            "options": {"align": opts["align"], "method": opts["method"], "weights": opts["weights"],
                        "data": os.path.abspath(opts["data"]) if opts["data"] else None,
                        "data_batches": len(data) if data else 0},
            "seconds": seconds, "alignments": _solver_summary(alignments)}
    with _progress(total=1, desc="writing") as bar:
        save_atomic(merged, out, tokenizer_from=first if os.path.isdir(first) else None, meta=meta,
                    force=opts["force"])
        bar.update()
    print(f"merged {len(models)} models ({opts['method']}, align={opts['align']}) into {out}")
    return 0


def _version():
    from . import __version__
    return __version__


# --- demo ----------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    from .demo import run_demo
    run_demo(out=args.out, seconds=args.seconds, force_retrain=args.retrain)
    return 0


# --- main ----------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(prog="symgraph", description="Graph-based symmetry compiler: analyse "
                                "and merge neural networks.")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line refusals")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("analyze", help="report the weight-space symmetries of a model")
    a.add_argument("model", help="save_pretrained directory, demo name (tiny-bert, tiny-gpt2, "
                   "tiny-llama, tiny-vit) or hub id")
    a.add_argument("--json", action="store_true", help="print only the JSON report")
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
    m.add_argument("--force", action="store_true", help="replace an existing --out")
    m.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    m.set_defaults(func=cmd_merge)

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
    try:
        return args.func(args)
    except TraceError as e:
        return _refuse(f"{e} Hint: symgraph traces the model with torch.export; models with "
                       "data-dependent control flow or unsupported ops cannot be traced. Run with "
                       "--debug for the full traceback.")
    except (SymgraphError, _Refusal, FileNotFoundError, ValueError, OSError) as e:
        return _refuse(str(e) if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        return _refuse("interrupted; nothing was written")


if __name__ == "__main__":
    sys.exit(main())

"""Merge options: the YAML config file and the command line's options over it.

A config is a mapping with these keys (all optional but ``models``; command-line values win)::

    models: [path_a, path_b, ...]   # save_pretrained directories, demo names or hub ids
    out: merged                     # output directory
    align: weights                  # weights | activations | none  (YAML false/null → none)
    method: average                 # a registered method: symgraph.merge_methods()
    weights: [0.5, 0.5]             # one mixing weight per model
    data: batches.safetensors       # 'input_ids' [N, S] (or 'pixel_values'), for activations
    force: false                    # replace an existing out

Relative paths are read relative to the config file.
"""
from __future__ import annotations

import os

from .errors import InputError
from .merging import get as get_method
from .merging import merge_methods

__all__ = ["MERGE_KEYS", "read_merge_config", "merge_options"]

MERGE_KEYS = {
    "models": "a list of at least 2 model paths / names",
    "out": "an output directory path (string)",
    "align": "one of 'weights', 'activations', 'none'",
    "method": "a merge method name (symgraph.merge_methods())",
    "weights": "a list of numbers, one per model",
    "data": "a path to a .safetensors or .pt data file (string)",
    "force": "true or false",
}


def read_merge_config(path: str) -> dict:
    """The options of a YAML merge config, checked; paths relative to the config file."""
    import yaml
    if not os.path.isfile(path):
        raise FileNotFoundError(f"merge config {path!r} does not exist; expected a YAML file with keys "
                                f"{', '.join(MERGE_KEYS)}")
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise InputError(f"merge config {path!r} is not valid YAML ({str(e).splitlines()[0]}); expected a "
                       f"mapping with keys {', '.join(MERGE_KEYS)}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"merge config {path!r} holds a {type(cfg).__name__}; expected a mapping with keys "
                       f"{', '.join(MERGE_KEYS)}")
    for k in cfg:
        if k not in MERGE_KEYS:
            raise InputError(f"merge config {path!r} has an unknown key {k!r}; expected only "
                           f"{', '.join(MERGE_KEYS)}")
    base = os.path.dirname(os.path.abspath(path))

    def rel(p):  # paths in the config are relative to the config file
        p = os.path.expanduser(p)
        q = os.path.join(base, p)
        return q if not os.path.isabs(p) and os.path.exists(q) else p

    def bad(k, v):
        return InputError(f"merge config {path!r}: key {k!r} is {v!r} ({type(v).__name__}); expected "
                        f"{MERGE_KEYS[k]}")

    out = {}
    if "models" not in cfg:
        raise InputError(f"merge config {path!r} has no 'models' key; expected {MERGE_KEYS['models']}")
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
        if cfg["method"] not in merge_methods():
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


def merge_options(args: dict) -> dict:
    """Merge options from the command line (``args``: argparse's namespace as a dict) over a
    ``config`` file's; refuses missing or inconsistent ones."""
    opts = {"models": [], "out": None, "align": "weights", "method": "average", "weights": None,
            "data": None, "force": False}
    if args.get("config"):
        opts.update(read_merge_config(args["config"]))
    # command-line values override the config
    if args.get("models"):
        if args.get("config") and opts["models"]:
            raise InputError("models given both on the command line and in --config; expected one or the other")
        opts["models"] = list(args["models"])
    for k in ("out", "align", "method", "weights", "data"):
        v = args.get(k)
        if v is not None:
            opts[k] = v
    if args.get("force"):
        opts["force"] = True
    if len(opts["models"]) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(opts['models'])}; expected "
                       "`symgraph merge A B [C ...] --out DIR` or `symgraph merge --config merge.yaml`")
    if not opts["out"]:
        raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")
    if opts["weights"] is not None and len(opts["weights"]) != len(opts["models"]):
        raise InputError(f"--weights has {len(opts['weights'])} values for {len(opts['models'])} models; "
                       "expected one weight per model")
    if opts["weights"] is not None and (any(w < 0 for w in opts["weights"]) or sum(opts["weights"]) <= 0):
        raise InputError(f"--weights {opts['weights']} must be non-negative with a positive sum")
    needs_data = get_method(opts["method"]).needs_data or opts["align"] == "activations"
    if needs_data and not opts["data"]:
        raise InputError(f"--align {opts['align']} with --method {opts['method']} needs --data FILE (a "
                       ".safetensors or .pt file with a tensor 'input_ids' [N, S]); expected --data, or "
                       "--align weights/none with --method average")
    return opts

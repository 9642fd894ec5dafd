"""The merge configuration: one frozen, validated :class:`MergeConfig` that
:func:`symgraph.merging.run.run_merge` takes, read from a YAML file and the command line's
options over it (:func:`merge_options`). Defaults and validation live here only.

A config is a mapping with these keys (all optional but ``models``; command-line values win)::

    models: [path_a, path_b, ...]   # save_pretrained directories, demo names or hub ids
    out: merged                     # output directory
    align: weights                  # weights | activations | none  (a bare no/off is refused)
    method: average                 # a registered method: symgraph.merge_methods()
    weights: [0.5, 0.5]             # one mixing weight per model
    data: batches.safetensors       # 'input_ids' [N, S] (or 'pixel_values'), for activations
    repair: false                   # REPAIR the merge's activation statistics (needs data)
    refine: 0                       # learned-matching steps after alignment (needs data)
    fold_norms: true                # residual streams as rotations (false: permutations)
    attention: heads                # heads | circuits (heads N times as wide: QK and OV interpolated)
    untie: false                    # give a tied head its own weights before aligning
    full_groups: false              # fit the GL part of heads and RoPE pair scales after the rotations
    sketch: 0                       # k > 0: weight-matching similarity through a k-column random projection
    tol: 0                          # weight matching keeps a class's element unless a re-solve gains more (relative)
    seen_rows: false                # weight matching reads only the embedding rows of tokens in data
    force: false                    # replace an existing out

Relative paths are read relative to the config file. A mergekit config (``merge_method:
linear``, ``models: [{model: ..., parameters: {weight: ...}}]``) is read too
(:func:`from_mergekit`).
"""
from __future__ import annotations

import os
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator)

from ..errors import InputError
from .methods.registry import get as get_method, mixing_weights, names as merge_methods

__all__ = ["MERGE_KEYS", "MergeConfig", "read_merge_config", "merge_options", "defaults", "to_yaml",
           "from_mergekit"]

MERGE_KEYS = {
    "models": "a list of at least 2 model paths / names",
    "out": "an output directory path (string)",
    "align": "one of 'weights', 'activations', 'none'",
    "method": "a merge method name (symgraph.merge_methods())",
    "weights": "a list of numbers, one per model",
    "data": "a path to a .safetensors or .pt data file (string)",
    "repair": "true or false (REPAIR needs data)",
    "refine": "a number of steps (an integer >= 0; needs data)",
    "fold_norms": "true or false",
    "attention": "one of 'heads', 'circuits'",
    "untie": "true or false",
    "full_groups": "true or false",
    "sketch": "a number of projection columns (an integer >= 0; 0: exact similarity)",
    "tol": "a relative gain in [0, 1) below which a re-solved class keeps its element (0: every change)",
    "seen_rows": "true or false (needs data)",
    "outputs": "a list of output names a symmetry must keep (e.g. [logits])",
    "device": "where to compute: 'cpu', 'cuda' or 'cuda:N' (not cpu: the models are loaded there)",
    "force": "true or false",
}


class MergeConfig(BaseModel):
    """A merge job (see the module docstring); frozen once built by :func:`merge_options`."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[StrictStr] = Field(min_length=2)
    out: StrictStr | None = None
    align: Literal["weights", "activations", "none"] = "weights"
    method: StrictStr = "average"
    weights: list[StrictFloat | StrictInt] | None = None
    data: StrictStr | None = None
    repair: StrictBool = False
    refine: StrictInt = 0
    fold_norms: StrictBool = True
    attention: Literal["heads", "circuits"] = "heads"
    untie: StrictBool = False
    full_groups: StrictBool = False
    sketch: StrictInt = 0
    tol: StrictFloat | StrictInt = 0
    seen_rows: StrictBool = False
    outputs: list[StrictStr] | None = Field(default=None, min_length=1)
    device: StrictStr = "cpu"
    force: StrictBool = False

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v):
        import torch
        try:
            dev = torch.device(v)
        except (RuntimeError, ValueError):
            raise ValueError("is not a device name; expected 'cpu', 'cuda' or 'cuda:N'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("names a CUDA device but this machine has none (torch.cuda.is_available() is "
                             "False); expected 'cpu', or a machine with a GPU and a CUDA build of torch")
        if dev.type != "cpu":
            try:
                torch.empty(1, device=dev)
            except (RuntimeError, AssertionError) as e:
                raise ValueError(f"cannot hold a tensor ({' '.join(str(e).split())[:120]}); expected a "
                                 "usable device") from None
        return str(dev)

    @field_validator("align", mode="before")
    @classmethod
    def _no_yaml_booleans(cls, v):
        if isinstance(v, bool) or v is None:
            raise ValueError(f"is the YAML value {v!r} (YAML reads no/off/false as a boolean); write "
                             "'none' in quotes, or 'weights' / 'activations'")
        return v

    @field_validator("method")
    @classmethod
    def _registered(cls, v):
        if v not in merge_methods():
            raise ValueError(f"is not a merge method; expected one of {merge_methods()}")
        return v


def _yaml_loader():
    """PyYAML's safe loader reading ``1e-3`` as a number, as YAML 1.2 does (PyYAML follows YAML
    1.1, whose floats need a dot: ``tol: 1e-3`` would be the string '1e-3')."""
    import re
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def read_merge_config(path: str) -> dict:
    """The options of a YAML merge config, validated; paths relative to the config file."""
    import yaml
    keys = ", ".join(MERGE_KEYS)
    from ..core.files import check_input_file
    check_input_file(path, "merge config", f"a YAML file with keys {keys}")
    try:
        with open(path) as f:
            cfg = yaml.load(f, Loader=_yaml_loader())  # a SafeLoader subclass
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"merge config {path!r} is not valid YAML ({str(e).splitlines()[0]}); expected a "
                         f"mapping with keys {keys}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"merge config {path!r} holds a {type(cfg).__name__}; expected a mapping with keys {keys}")
    if "merge_method" in cfg or any(isinstance(m, dict) for m in cfg.get("models") or []):
        cfg = from_mergekit(cfg, path)
    try:
        parsed = MergeConfig.model_validate(cfg)
    except ValidationError as e:
        raise InputError(_explain(path, cfg, e.errors()[0])) from None
    base = os.path.dirname(os.path.abspath(path))

    def rel(p):  # paths in the config are relative to the config file
        p = os.path.expanduser(p)
        q = os.path.join(base, p)
        return q if not os.path.isabs(p) and os.path.exists(q) else p

    out = parsed.model_dump(exclude_unset=True)
    out["models"] = [rel(m) for m in parsed.models]
    if parsed.out is not None:
        o = os.path.expanduser(parsed.out)
        out["out"] = o if os.path.isabs(o) else os.path.join(base, o)
    if parsed.data is not None:
        out["data"] = rel(parsed.data)
    if parsed.weights is not None:
        out["weights"] = [float(x) for x in parsed.weights]
    return out


#: mergekit methods that combine task vectors against a shared base model.
_NEEDS_BASE = {"task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties",
               "della", "della_linear", "model_stock", "sce", "nearswap"}


def from_mergekit(cfg: dict, path: str) -> dict:
    """symgraph's options from a mergekit config (``merge_method``, ``models: [{model:,
    parameters: {weight:}}]``, ``parameters: {normalize:}``, ``dtype``): ``linear`` is
    symgraph's ``average`` (after alignment: symgraph aligns first, unless ``align: none``);
    methods that need a ``base_model`` are refused with the reason; other keys by name."""
    cfg = dict(cfg)
    where = f"mergekit config {path!r}"
    method = cfg.pop("merge_method", "linear")
    if method in _NEEDS_BASE or cfg.get("base_model") is not None:
        raise InputError(f"{where}: merge_method {method!r}{' with a base_model' if cfg.get('base_model') else ''} "
                         "combines task vectors against a shared base model, and symgraph merges models that "
                         "share no base (it aligns them first); expected merge_method linear (symgraph's average), "
                         "or align with symgraph and merge with mergekit")
    if method != "linear" and method not in merge_methods():
        raise InputError(f"{where}: merge_method {method!r} has no symgraph counterpart; expected linear "
                         f"(symgraph's average) or one of {merge_methods()}")
    cfg["method"] = "average" if method == "linear" else method
    cfg.pop("base_model", None)
    dtype = cfg.pop("dtype", None)
    if dtype is not None:  # mergekit's compute dtype: symgraph computes in float32 (or wider) anyway
        if dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise InputError(f"{where}: dtype {dtype!r}; expected float32, float16 or bfloat16 (mergekit's "
                             "compute dtype)")
        import sys
        print(f"symgraph: note: dtype {dtype} in {where}: symgraph computes in float32 (float64 for float64 "
              "models) and writes each tensor in the first model's dtype", file=sys.stderr)
    top = dict(cfg.pop("parameters", None) or {})
    if top.pop("normalize", True) is not True:
        raise InputError(f"{where}: parameters.normalize false; symgraph always normalises the weights to sum "
                         "to 1; expected normalize: true or no key")
    if top:
        raise InputError(f"{where}: parameters {sorted(top)} are not symgraph options; expected only weight "
                         "(per model) and normalize")
    models, weights = [], []
    for i, m in enumerate(cfg.get("models") or []):
        if not isinstance(m, dict) or not isinstance(m.get("model"), str):
            raise InputError(f"{where}: models[{i}] is {m!r}; expected {{model: path, parameters: {{weight: w}}}}")
        extra = sorted(set(m) - {"model", "parameters"})
        params = dict(m.get("parameters") or {})
        w = params.pop("weight", None)
        if extra or params:
            raise InputError(f"{where}: models[{i}] has {extra + sorted(params)}; expected only model and "
                             "parameters.weight")
        models.append(m["model"])
        weights.append(w)
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise InputError(f"{where}: some models have a weight and others not; expected a weight for each or none")
    cfg["models"] = models
    if weights and weights[0] is not None:
        cfg["weights"] = weights
    return cfg


def _explain(path, cfg, err) -> str:
    """One line for pydantic's first error, naming the key."""
    key = str(err["loc"][0]) if err.get("loc") else "?"
    if err["type"] == "extra_forbidden":
        return f"merge config {path!r} has an unknown key {key!r}; expected only {', '.join(MERGE_KEYS)}"
    if err["type"] == "missing":
        return f"merge config {path!r} has no {key!r} key; expected {MERGE_KEYS[key]}"
    v = cfg.get(key)
    why = err.get("msg", "").removeprefix("Value error, ")
    why = f" ({why})" if err["type"] == "value_error" else ""
    return (f"merge config {path!r}: key {key!r} is {v!r} ({type(v).__name__}){why}; expected "
            f"{MERGE_KEYS.get(key, 'a valid value')}")


def defaults() -> dict:
    """Every option's default, from the schema."""
    return {k: f.default for k, f in MergeConfig.model_fields.items() if k != "models"} | {"models": []}


def merge_options(args: dict) -> MergeConfig:
    """The merge job from the command line (``args``: argparse's namespace as a dict) over a
    ``config`` file's options; refuses missing or inconsistent ones."""
    opts = defaults()
    from_file: set = set()
    if args.get("config"):
        read = read_merge_config(args["config"])
        opts.update(read)
        from_file = {k for k in read if k != "models"}
    # command-line values override the config
    if args.get("models"):
        if args.get("config") and opts["models"]:
            raise InputError("models given both on the command line and in --config; expected one or the other")
        opts["models"] = list(args["models"])
    given = [k for k in ("out", "align", "method", "weights", "data", "outputs", "attention", "device",
                         "sketch", "tol")
             if args.get(k) is not None]
    given += [f for f in ("force", "repair", "untie", "full_groups", "seen_rows") if args.get(f)]
    given += ["refine"] * (args.get("refine") is not None) + ["fold_norms"] * bool(args.get("no_fold_norms"))
    for k in given:
        opts[k] = False if k == "fold_norms" else (True if k in ("force", "repair", "untie", "full_groups",
                                                                 "seen_rows") else args[k])
    from_file -= set(given)
    config = args.get("config")
    check(opts, lambda k: f"'{k}:' in {config}" if k in from_file else
          ("--no-fold-norms" if k == "fold_norms" else "--" + k.replace("_", "-")))
    if opts["refine"]:
        opts["align"] = "activations"  # learned matching starts from activation matching
    return MergeConfig.model_validate(opts)


def check(opts: dict, name=lambda k: "--" + k.replace("_", "-")) -> None:
    """The checks between options (one option's type is the schema's job); ``name(key)`` says
    where an option came from in a refusal (``--refine``, or ``'refine:' in merge.yaml``)."""
    n = name
    data = f"{n('data')} FILE" if n("data").startswith("--") else n("data")
    if opts["refine"] < 0:
        said = (f"{n('refine')} {opts['refine']}" if n("refine").startswith("--")
                else n("refine").replace("refine:", f"refine: {opts['refine']}"))
        raise InputError(f"{said}: expected a number of steps >= 0")
    if opts["refine"] and not opts["data"]:
        raise InputError(f"{n('refine')} needs {data} (batches for activation matching and the loss)")
    if opts["refine"] and opts["align"] in ("none", None):
        raise InputError(f"{n('refine')} needs an alignment to refine; expected {n('align')} activations")
    if len(opts["models"]) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(opts['models'])}; expected "
                         "`symgraph merge A B [C ...] --out DIR` or `symgraph merge --config merge.yaml`")
    if not opts["out"]:
        raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")
    if opts["weights"] is not None:
        mixing_weights(opts["weights"], len(opts["models"]))
    if opts["attention"] == "circuits" and (opts["method"] != "average" or opts["repair"]):
        raise InputError(f"{n('attention')} circuits merges by averaging; expected {n('method')} average without "
                         f"{n('repair')}")
    if opts["sketch"] < 0:
        raise InputError(f"{n('sketch')} {opts['sketch']}: expected a number of projection columns >= 0")
    if opts["sketch"] and opts["align"] != "weights":
        raise InputError(f"{n('sketch')} sketches weight matching; expected {n('align')} weights")
    if not 0 <= opts["tol"] < 1:
        raise InputError(f"{n('tol')} {opts['tol']}: expected a relative gain in [0, 1)")
    if opts["tol"] and opts["align"] != "weights":
        raise InputError(f"{n('tol')} ends the sweeps of weight matching; expected {n('align')} weights")
    if opts["seen_rows"] and not opts["data"]:
        raise InputError(f"{n('seen_rows')} reads the embedding rows of the tokens in the data; expected {data}")
    if opts["seen_rows"] and opts["align"] != "weights":
        raise InputError(f"{n('seen_rows')} restricts weight matching; expected {n('align')} weights")
    if opts["full_groups"] and opts["align"] in ("none", None):
        raise InputError(f"{n('full_groups')} fits the groups an alignment solves; expected {n('align')} weights "
                         "or activations")
    if opts["repair"] and not opts["data"]:
        raise InputError(f"{n('repair')} needs {data} (batches to measure activation statistics on)")
    needs_data = get_method(opts["method"]).needs_data or opts["align"] == "activations"
    if needs_data and not opts["data"]:
        raise InputError(f"{n('align')} {opts['align']} with {n('method')} {opts['method']} needs {data} (a "
                         ".safetensors or .pt file with a tensor 'input_ids' [N, S]); expected it, or "
                         f"{n('align')} weights/none with {n('method')} average")


def to_yaml(cfg: MergeConfig, out: str = "merged") -> str:
    """The YAML config that reproduces ``cfg`` (options at their default left out)."""
    import yaml
    d = cfg.model_dump(exclude_defaults=True, exclude={"force", "out", "models"})
    head = {"models": list(cfg.models), "align": cfg.align, "method": cfg.method}
    return yaml.safe_dump({**head, **d, "out": out}, sort_keys=False, allow_unicode=True)

"""The merge configuration: one frozen, validated :class:`MergeConfig` that
:func:`symgraph.app.run.run_merge` takes, read from a YAML file and the command line's
options over it (:func:`merge_options`). Defaults and validation live in the schema only.

Every option is declared once, as a field of :class:`MergeConfig` (its description, what a
refusal says is expected, its metavar): the YAML keys, the ``symgraph merge`` flags
(:mod:`symgraph.app.options`), the defaults and the docs' table (``docs/options.md``) are
derived from that declaration. The alignment options a merge shares with :func:`symgraph.align`
(``refine``, ``sketch``, ``tol``, ``outputs``, ``fold_norms``, ``full_groups``) take their type,
range and default from :class:`~symgraph.alignment.options.AlignOptions`, so the two accept and
refuse the same values. A config is a mapping of those keys (all optional but
``models``; command-line values win), e.g.::

    models: [path_a, path_b]
    align: activations
    data: batches.safetensors
    out: merged

Relative paths are read relative to the config file. A mergekit config (``merge_method:
linear``, ``models: [{model: ..., parameters: {weight: ...}}]``) is read too
(:func:`~symgraph.app.mergekit_config.from_mergekit`).
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

from ..alignment.options import MAX_REFINE, AlignOptions, Columns, Fraction, Outputs, Steps, Sweeps
from ..checkpoints.sharded import parse_size
from ..core.schema import error_key, expected, refusal, short_repr as _short
from ..errors import InputError
from ..merging.methods.registry import get as get_method, names as merge_methods
from .mergekit_config import from_mergekit
from .options import flag, given_options
from .rules import check, refused

__all__ = ["MERGE_KEYS", "MAX_REFINE", "MergeConfig", "read_merge_config", "merge_options", "defaults", "to_yaml",
           "from_mergekit", "build_config", "check"]

#: Device types that hold no values (every other one is checked to hold a tensor before a merge).
NO_COMPUTE_DEVICES = ("meta",)
#: The largest --memory-budget (bytes: 1000000GB; a larger one is a typo, or an overflow).
MAX_BUDGET = 10 ** 15
#: The largest merge config read (a config is a few lines), and how deep its values may nest.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32


def _opt(expected: str, cli: bool = True, metavar: str | None = None, flag: str | None = None) -> dict:
    """A field's extra declaration: what a refusal says is ``expected`` of its value, and
    whether the command line has a flag for it (:mod:`symgraph.app.options` derives the
    flag, its help and the docs' row from the field; ``flag`` when it is not ``--key``)."""
    return {"expected": expected, "cli": cli, **({"metavar": metavar} if metavar else {}),
            **({"flag": flag} if flag else {})}


def _align(key: str, description: str, metavar: str | None = None, wanted: str | None = None) -> Any:
    """A field :class:`~symgraph.alignment.options.AlignOptions` declares too: annotated with the
    type it declares (``Steps``, ``Columns``, ...: type and range), its default taken from there
    (and what a refusal expects, unless ``wanted`` says it for the command line); only the
    command line's description and metavar are added here."""
    return Field(AlignOptions.model_fields[key].default, description=description,
                 json_schema_extra=_opt(wanted or expected(AlignOptions, key), metavar=metavar))


class _OneLine(type(BaseModel)):  # type: ignore[misc]  # pydantic's model metaclass
    """``MergeConfig(...)`` refused in one :class:`InputError` line, the command line's (a
    metaclass: pydantic runs a model's own ``__init__`` inside ``model_validate`` too, without
    its context)."""
    def __call__(cls, *args, **fields):
        try:
            return super().__call__(*args, **fields)
        except ValidationError as e:
            raise InputError(refused(e, fields, lambda k: flag(MergeConfig, k), MergeConfig)) from None


class MergeConfig(BaseModel, metaclass=_OneLine):
    """A merge job (see the module docstring): frozen, and checked whole when built, however it is
    built (:func:`merge_options` from a command line and a YAML file, :func:`build_config` or
    ``MergeConfig(...)`` in Python): each field by its type and range, the fields together by
    :func:`check` (``repair`` needs ``data``, ...). Built in Python, a refusal is one
    :class:`~symgraph.errors.InputError` line, the one the command line prints."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[StrictStr] = Field(min_length=2, description="the models: save_pretrained directories, demo "
                                    "names or hub ids (on the command line: the positional arguments)",
                                    json_schema_extra=_opt("a list of at least 2 model paths / names", cli=False,
                                                           metavar="models"))
    out: StrictStr | None = Field(None, description="output directory (must not exist unless --force)",
                                  json_schema_extra=_opt("an output directory path (string)", metavar="DIR"))
    align: Literal["weights", "activations", "none"] = Field(
        "weights", description="how B is put into A's basis first: by weights (data-free), by activations "
        "(needs data) or not at all", json_schema_extra=_opt("one of 'weights', 'activations', 'none'"))
    method: StrictStr = Field("average", description="how the aligned models are combined (a registered method)",
                              json_schema_extra=_opt("a merge method name (symgraph.merge_methods())"))
    parameters: dict[StrictStr, Any] = Field(
        {}, description="the merge method's parameters, NAME=VALUE (e.g. alpha=0.1 for regmean; mergekit's "
        "parameters: key); each method declares its own, recorded in symgraph_merge.json",
        json_schema_extra=_opt("a mapping of the method's parameter names to values", metavar="NAME=VALUE",
                               flag="--parameter"))
    anchor: StrictInt | Literal["universe"] = Field(
        0, description="the model the others are aligned to (its index), or universe: every model aligned to the "
        "mean of the others, round after round (MergeMany), out of core within the budget",
        json_schema_extra=_opt("a model index (0, 1, ...) or 'universe'", metavar="N|universe"))
    weights: list[Annotated[StrictFloat, Field(allow_inf_nan=False)] | StrictInt] | None = Field(
        None, description="one mixing weight per model (normalised to sum 1; default: equal)",
        json_schema_extra=_opt("a list of numbers, one per model, each finite", metavar="W"))
    data: StrictStr | None = Field(None, description=".safetensors/.pt file with 'input_ids' [N, S] (or "
                                   "'pixel_values'), for activation statistics",
                                   json_schema_extra=_opt("a path to a .safetensors or .pt data file (string)", metavar="FILE"))
    repair: StrictBool = Field(False, description="REPAIR: renormalise the merge's hidden activations to the "
                               "inputs' interpolated mean and std (needs --data)",
                               json_schema_extra=_opt("true or false (REPAIR needs data)"))
    refine: Steps = _align("refine", "learned matching: N optimisation steps after activation matching, on the "
                           "model's own loss over --data (align then defaults to activations; an explicit "
                           "--align weights or none is refused)", "N",
                           f"a number of steps (an integer >= 0, at most {MAX_REFINE}; needs data)")
    fold_norms: StrictBool = _align("fold_norms", "fold norm gains into the layers that read them, so residual "
                                    "streams admit rotations (off: they stay permutations)")
    attention: Literal["heads", "circuits"] = Field(
        "heads", description="circuits: each merged head interpolates the parents' QK and OV forms (heads N "
        "times as wide; needs a config with head_dim)", json_schema_extra=_opt("one of 'heads', 'circuits'"))
    untie: StrictBool = Field(False, description="give a tied head its own weights first (the residual stream "
                              "then admits orthogonal maps; one more vocabulary x width matrix)",
                              json_schema_extra=_opt("true or false"))
    full_groups: StrictBool = _align("full_groups", "after the rotations, fit each head's GL map and each RoPE "
                                     "pair's scale (the full groups the report claims)")
    sketch: Columns = _align("sketch", "weight matching compares permutation classes through a shared random "
                             "projection of K columns where a matrix is wider than 2K (0: exact)", "K")
    tol: Fraction = _align("tol", "weight matching keeps a class's element unless re-solving it gains more than "
                           "this fraction of its objective (0: every change)", "X")
    max_iter: Sweeps = _align("max_iter", "weight matching stops after at most this many sweeps of coordinate "
                              "descent", "N")
    until: Literal["exact", "discrete", "gap"] = _align(
        "until", "the sweeps end, from the second on, once one changes no permutation or head matching and "
        "closes under 5 percent of any unit's gap to its bound (gap, default), once one changes no element (exact), "
        "or no permutation or head matching (discrete: faster, rotations less converged)")
    seen_rows: StrictBool = Field(False, description="weight matching reads only the token-embedding rows of "
                                  "tokens in --data (Theus et al. 2025)",
                                  json_schema_extra=_opt("true or false (needs data)"))
    outputs: Outputs = _align("outputs", "the outputs a symmetry must keep (e.g. logits; default: all)", "NAME",
                              "a list of output names a symmetry must keep (e.g. [logits])")
    device: StrictStr = Field("cpu", description="compute on this device (cpu, cuda, cuda:N; like mergekit's "
                              "--cuda): out of core, tensors are read from disk, computed there and written "
                              "back; in memory, the models are loaded there",
                              json_schema_extra=_opt("where to compute: 'cpu', 'cuda' or 'cuda:N'", metavar="DEV"))
    memory_budget: StrictStr | None = Field(None, description="bytes the out-of-core engine may hold at once "
                                            "(its caches, a pass of statistics, a group's working copies), "
                                            "e.g. 2GB; default: fixed sizes of about 0.5 GB",
                                            json_schema_extra=_opt(f"a size such as '2GB' or '500MB', above 0 and at most {MAX_BUDGET // 10 ** 9}GB",
                                                                   metavar="SIZE"))
    max_shard_size: StrictStr | None = Field(None, description="largest file of the merged checkpoint, e.g. "
                                             "2GB; default: a sharded anchor's largest shard, so the output is "
                                             "sharded like the input (else 2 GiB)",
                                             json_schema_extra=_opt("a size such as '2GB' or '500MB'",
                                                                    metavar="SIZE"))
    force: StrictBool = Field(False, description="replace an existing --out (a previous symgraph output)",
                              json_schema_extra=_opt("true or false"))

    @field_validator("memory_budget", "max_shard_size")
    @classmethod
    def _a_size(cls, v):
        if v is not None:
            try:
                size = parse_size(v)
            except (InputError, OverflowError):  # 1e999GB: a float that is inf
                size = None
            if size is None or not 0 < size <= MAX_BUDGET:
                raise ValueError(f"is not a size from 1B to {MAX_BUDGET // 10 ** 9}GB; expected a size such as '2GB' "
                                 "or '500MB'")
        return v

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v):
        import torch
        try:
            dev = torch.device(v)
        except (RuntimeError, ValueError):
            raise ValueError("is not a device name; expected 'cpu', 'cuda' or 'cuda:N'") from None
        if dev.type in NO_COMPUTE_DEVICES:  # a meta tensor has a shape and no values: nothing to compute with
            raise ValueError(f"is not a device symgraph computes on ({dev.type} tensors hold no values); expected "
                             "'cpu', 'cuda' or 'cuda:N'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("names a CUDA device but this machine has none (torch.cuda.is_available() is "
                             "False); expected 'cpu', or a machine with a GPU and a CUDA build of torch")
        if dev.type != "cpu":
            try:
                torch.empty(1, device=dev)
            except Exception as e:  # noqa: BLE001 - no backend (xla, ipu), not compiled in (xpu), no module (hpu)
                said = " ".join(str(e).split()).split(". ")[0][:120]  # the first sentence
                raise ValueError(f"cannot hold a tensor ({type(e).__name__}: {said}); "
                                 "expected 'cpu', 'cuda', 'cuda:N' or another device this torch build "
                                 "has") from None
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

    @model_validator(mode="after")
    def _consistent(self, info):
        """The rules between fields (:func:`check`), named as the context's ``name(key)`` says
        (default: the flags); a context ``{"fields_only": True}`` (a YAML file read before the
        command line completes it) skips them, ``{"batches": True}`` says data come as batches
        already loaded rather than as ``data``."""
        ctx = info.context or {}
        if not ctx.get("fields_only"):
            check(self.model_dump(), ctx.get("name") or (lambda k: flag(MergeConfig, k)), ctx.get("batches", False))
        return self

    @field_validator("parameters")
    @classmethod
    def _declared(cls, v, info):
        """The method's parameters, each checked by its ``Parameters`` declaration (the values
        typed as it declares them: a command line's ``alpha=0.1`` is the number 0.1)."""
        if "method" not in info.data:  # the method itself was refused
            return v
        try:
            params = get_method(info.data["method"], **v).params
        except InputError as e:
            raise ValueError(str(e)) from None
        return {k: getattr(params, k) for k in v}


#: What each key of a merge config expects (derived from the schema).
MERGE_KEYS = {k: expected(MergeConfig, k) for k in MergeConfig.model_fields}


class _Unreadable(Exception):
    """A config's YAML that the loader refuses to read on (an alias, nesting too deep, a key
    given twice): the reason, completed with the file's name by :func:`read_merge_config`."""


def _yaml_loader():
    """PyYAML's safe loader reading ``1e-3`` as a number, as YAML 1.2 does (PyYAML follows YAML
    1.1, whose floats need a dot: ``tol: 1e-3`` would be the string '1e-3'); bounded: an alias
    (``*name``, what a "billion laughs" file multiplies itself with) is refused, values nest at
    most :data:`MAX_CONFIG_DEPTH` deep, and a mapping may not give a key twice (YAML would keep
    the last silently)."""
    import re
    import yaml

    class Loader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                ev = self.peek_event()
                raise _Unreadable(f"uses a YAML alias (*{ev.anchor}, line {ev.start_mark.line + 1}); expected "
                                  "plain values: a merge config takes no anchors (&name) or aliases (*name)")
            self._depth += 1
            try:
                if self._depth > MAX_CONFIG_DEPTH:
                    mark = self.peek_event().start_mark
                    raise _Unreadable(f"nests values more than {MAX_CONFIG_DEPTH} deep (line {mark.line + 1}); "
                                      "expected a mapping of options, each a value or a list of values")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if (key.tag, key.value) in seen:
                        raise _Unreadable(f"gives the key {key.value[:80]!r} twice (line {key.start_mark.line + 1}); "
                                          "expected each key once")
                    seen.add((key.tag, key.value))
            return super().construct_mapping(node, deep)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def _is_path(spec: str, base: str) -> bool:
    """Whether a model ``spec`` in a config is a path (as :func:`symgraph.app.run.check_paths`
    tells them): starting with '.', '/' or '~', with more than one '/', or a name that exists
    beside the config; anything else is a demo name or hub id."""
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith("/")
            or os.path.exists(os.path.join(base, spec)))


def read_merge_config(path: str) -> dict:
    """The options of a YAML merge config, validated; paths relative to the config file."""
    import yaml
    keys = ", ".join(MERGE_KEYS)
    from ..core.files import check_input_file
    check_input_file(path, "merge config", f"a YAML file with keys {keys}")
    with open(os.path.expanduser(path), "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"merge config {path!r} is over {MAX_CONFIG_BYTES >> 20} MiB; expected a YAML file of "
                         f"a few lines (at most {MAX_CONFIG_BYTES >> 20} MiB) with keys {keys}")
    try:
        cfg = yaml.load(raw.decode("utf-8"), Loader=_yaml_loader())  # a SafeLoader subclass
    except _Unreadable as e:
        raise InputError(f"merge config {path!r} {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"merge config {path!r} is not valid YAML ({str(e).splitlines()[0][:200]}); expected a "
                         f"mapping with keys {keys}") from None
    except (ValueError, OverflowError, RecursionError) as e:  # a value YAML parses but Python cannot hold
        raise InputError(f"merge config {path!r} holds a value that cannot be read ({' '.join(str(e).split())[:160]}); "
                         f"expected a mapping with keys {keys}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"merge config {path!r} holds a {type(cfg).__name__}; expected a mapping with keys {keys}")
    listed = cfg.get("models")
    if "merge_method" in cfg or (isinstance(listed, list) and any(isinstance(m, dict) for m in listed)):
        cfg = from_mergekit(cfg, path)
    try:
        parsed = MergeConfig.model_validate(cfg, context={"fields_only": True})  # the rules between: once complete
    except ValidationError as e:
        raise InputError(_explain(path, cfg, e.errors()[0])) from None
    base = os.path.dirname(os.path.abspath(os.path.expanduser(path)))

    def resolve(p, what):
        """A path of the config, relative to the config file (never to the working directory)."""
        q = os.path.normpath(os.path.join(base, os.path.expanduser(p)))
        if not os.path.exists(q):
            rel = "" if os.path.isabs(os.path.expanduser(p)) else " (relative paths in a config are relative " \
                                                                 "to the config file)"
            want = "a save_pretrained directory, a demo name or a hub id" if what == "model" else "a data file"
            raise InputError(f"merge config {path!r}: {what} {_short(p)} does not exist: no {q!r}{rel}; expected "
                             f"{want}")
        return q

    def model(m):
        if _is_path(m, base):
            return resolve(m, "model")
        if os.path.exists(os.path.expanduser(m)):  # loading would take it from the working directory
            raise InputError(f"merge config {path!r}: model {_short(m)} is not beside the config (no "
                             f"{os.path.join(base, m)!r}) but names {os.path.abspath(m)!r} in the working directory; "
                             "relative paths in a config are relative to the config file; expected a path from the "
                             "config's directory, an absolute path, or a demo name or hub id that is no local path")
        return m  # a demo name or a hub id

    out = parsed.model_dump(exclude_unset=True)
    out["models"] = [model(m) for m in parsed.models]
    if parsed.out is not None:
        o = os.path.expanduser(parsed.out)
        out["out"] = o if os.path.isabs(o) else os.path.join(base, o)
    if parsed.data is not None:
        out["data"] = resolve(parsed.data, "data")
    if parsed.weights is not None:
        try:
            out["weights"] = [float(x) for x in parsed.weights]
        except OverflowError:
            raise InputError(f"merge config {path!r}: key 'weights' is {_short(parsed.weights)}, a number too large "
                             f"for a float; expected {MERGE_KEYS['weights']}") from None
    return out


def _explain(path, cfg, err) -> str:
    """One line for pydantic's first error, naming the key."""
    key = error_key(err)
    if err["type"] == "extra_forbidden":
        return f"merge config {path!r} has an unknown key {key!r}; expected only {', '.join(MERGE_KEYS)}"
    if err["type"] == "missing":
        return f"merge config {path!r} has no {key!r} key; expected {MERGE_KEYS[key]}"
    v = cfg.get(key)
    return refusal(err, f"merge config {path!r}: key {key!r} is {_short(v)} ({type(v).__name__})",
                   MERGE_KEYS.get(key, "a valid value"))


def build_config(fields: dict, *, batches: bool = False, name=None) -> MergeConfig:
    """A :class:`MergeConfig` of ``fields``, checked whole, or one :class:`InputError` line;
    ``batches``: the data come as batches already loaded (``run_merge(cfg, data=...)``), so
    the options that need data have it without ``data``; ``name(key)``: how a refusal names
    an option (default: its flag)."""
    name = name or (lambda k: flag(MergeConfig, k))
    try:
        return MergeConfig.model_validate(fields, context={"batches": batches, "name": name})
    except ValidationError as e:
        raise InputError(refused(e, fields, name, MergeConfig)) from None


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
    given = given_options(args, MergeConfig)  # the flags the command line set (the schema's fields)
    opts.update(given)
    from_file -= set(given)
    config = args.get("config")

    def where(k):
        return f"'{k}:' in {config}" if k in from_file else flag(MergeConfig, k)
    _job(opts)
    if opts["refine"] and opts["align"] == "weights" and ("align" in given or "align" in from_file):
        raise InputError(f"{where('refine')} starts from activation matching, and {where('align')} says weights; "
                         f"expected {flag(MergeConfig, 'align')} activations (or no align: refine sets it)")
    cfg = build_config(opts, name=where)  # every field, then the rules between them (check)
    if cfg.refine:  # learned matching starts from activation matching (said in --help; an explicit align refused)
        cfg = cfg.model_copy(update={"align": "activations"})
    return cfg


def _job(opts: dict) -> None:
    """What every merge needs, asked for as the command line spells it: two models and an output."""
    if len(opts["models"]) < 2:
        raise InputError(f"merge needs at least 2 models, got {len(opts['models'])}; expected "
                         "`symgraph merge A B [C ...] --out DIR` or `symgraph merge --config merge.yaml`")
    if not opts["out"]:
        raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")


def to_yaml(cfg: MergeConfig, out: str = "merged") -> str:
    """The YAML config that reproduces ``cfg`` (options at their default left out)."""
    import yaml
    d = cfg.model_dump(exclude_defaults=True, exclude={"force", "out", "models"})
    head = {"models": list(cfg.models), "align": cfg.align, "method": cfg.method}
    return yaml.safe_dump({**head, **d, "out": out}, sort_keys=False, allow_unicode=True)


if __name__ == "__main__":  # python -m symgraph.app.config > docs/options.md
    from .options import options_page
    print(options_page(MergeConfig), end="")

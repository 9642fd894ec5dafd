"""The one merge configuration: a frozen, validated :class:`MergeConfig` that every entry takes
(``symgraph merge`` and YAML through :mod:`symgraph.app.config`, :func:`symgraph.merge`,
:func:`symgraph.merge_checkpoints`, the merge engine), and the rules between its options
(:func:`check`, its validator), each refusal one line naming the options as they were given.
Every option is declared once, as a field: the YAML keys, flags and docs derive from it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

from ..alignment.options import MAX_REFINE, AlignOptions, Columns, Fraction, Outputs, Steps, Sweeps
from ..checkpoints.sharded import parse_size
from ..core.devices import usable_device
from ..core.schema import expected, flag, refused
from ..errors import InputError
from .methods.registry import get as get_method, mixing_weights, names as merge_methods

__all__ = ["MergeConfig", "MERGE_KEYS", "MAX_REFINE", "MAX_BUDGET", "check", "refused", "engine_config",
           "solver_options"]

#: The largest --memory-budget (bytes: 1000000GB; a larger one is a typo, or an overflow).
MAX_BUDGET = 10 ** 15


def _field(default, description: str, expected: str, *, cli: bool = True, metavar: str | None = None,
           flag: str | None = None, **constraints) -> Any:
    """A field's declaration: its default, ``description`` (the help and YAML text), what a
    refusal says is ``expected``, and whether the command line has a flag for it (``flag``
    when it is not ``--key``; :mod:`symgraph.app.options` derives it)."""
    extra: dict[str, Any] = {"expected": expected, "cli": cli, **({"metavar": metavar} if metavar else {}),
                             **({"flag": flag} if flag else {})}
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def _align(key: str, description: str, metavar: str | None = None, wanted: str | None = None) -> Any:
    """A field :class:`~symgraph.alignment.options.AlignOptions` declares too (annotated with its
    type there), its default and what a refusal expects (unless ``wanted``) taken from there."""
    return _field(AlignOptions.model_fields[key].default, description, wanted or expected(AlignOptions, key),
                  metavar=metavar)


def _registered(method: str) -> str:
    """``method``, refused unless a registered merge method."""
    if method not in merge_methods():
        raise ValueError(f"is not a merge method; expected one of {merge_methods()}")
    return method


class _OneLine(type(BaseModel)):  # type: ignore[misc]  # pydantic's model metaclass
    """``MergeConfig(...)`` refused in one :class:`InputError` line, the command line's (a
    metaclass: pydantic runs a model's own ``__init__`` inside ``model_validate`` too)."""
    def __call__(cls, *args, **fields):
        try:
            return super().__call__(*args, **fields)
        except ValidationError as e:
            raise InputError(refused(e, fields, lambda k: flag(MergeConfig, k), MergeConfig)) from None


class MergeConfig(BaseModel, metaclass=_OneLine):
    """A merge job (see the module docstring): frozen, and checked whole however it is built
    (from a command line and YAML, :func:`build_config` or ``MergeConfig(...)``): each field by
    its type and range, the fields together by :func:`check`, in the command line's one line."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[StrictStr] = _field(..., "the models: save_pretrained directories, demo names or hub ids (on the "
                                     "command line: the positional arguments)",
                                     "a list of at least 2 model paths / names", cli=False, metavar="models",
                                     min_length=2)
    out: StrictStr | None = _field(None, "output directory (must not exist unless --force)",
                                   "an output directory path (string)", metavar="DIR")
    align: Literal["weights", "activations", "none"] = _field(
        "weights", "how B is put into A's basis first: by weights (data-free), by activations (needs data) or not "
        "at all", "one of 'weights', 'activations', 'none'")
    method: Annotated[StrictStr, AfterValidator(_registered)] = _field(
        "average", "how the aligned models are combined (a registered method)",
        "a merge method name (symgraph.merge_methods())")
    parameters: dict[StrictStr, Any] = _field(
        {}, "the merge method's parameters, NAME=VALUE (e.g. alpha=0.1 for regmean; mergekit's parameters: key); "
        "each method declares its own, recorded in symgraph_merge.json",
        "a mapping of the method's parameter names to values", metavar="NAME=VALUE", flag="--parameter")
    anchor: StrictInt | Literal["universe"] = _field(
        0, "the model the others are aligned to (its index), or universe: every model aligned to the mean of the "
        "others, round after round (MergeMany), out of core within the budget",
        "a model index (0, 1, ...) or 'universe'", metavar="N|universe")
    weights: list[Annotated[StrictFloat, Field(allow_inf_nan=False)] | StrictInt] | None = _field(
        None, "one mixing weight per model (normalised to sum 1; default: equal)",
        "a list of numbers, one per model, each finite", metavar="W")
    data: StrictStr | None = _field(None, ".safetensors/.pt file with 'input_ids' [N, S] (or 'pixel_values'), for "
                                    "activation statistics", "a path to a .safetensors or .pt data file (string)",
                                    metavar="FILE")
    repair: StrictBool = _field(False, "REPAIR: renormalise the merge's hidden activations to the inputs' "
                                "interpolated mean and std (needs --data)", "true or false (REPAIR needs data)")
    refine: Steps = _align("refine", "learned matching: N optimisation steps after activation matching, on the "
                           "model's own loss over --data (align then defaults to activations; an explicit "
                           "--align weights or none is refused)", "N",
                           f"a number of steps (an integer >= 0, at most {MAX_REFINE}; needs data)")
    fold_norms: StrictBool = _align("fold_norms", "fold norm gains into the layers that read them, so residual "
                                    "streams admit rotations (off: they stay permutations)")
    attention: Literal["heads", "circuits"] = _field(
        "heads", "circuits: each merged head interpolates the parents' QK and OV forms (heads N times as wide; "
        "needs a config with head_dim)", "one of 'heads', 'circuits'")
    untie: StrictBool = _field(False, "give a tied head its own weights first (the residual stream then admits "
                               "orthogonal maps; one more vocabulary x width matrix)", "true or false")
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
    seen_rows: StrictBool = _field(False, "weight matching reads only the token-embedding rows of tokens in --data "
                                   "(Theus et al. 2025)", "true or false (needs data)")
    outputs: Outputs = _align("outputs", "the outputs a symmetry must keep (e.g. logits; default: all)", "NAME",
                              "a list of output names a symmetry must keep (e.g. [logits])")
    device: StrictStr = _field("cpu", "compute on this device (cpu, cuda, cuda:N; like mergekit's --cuda): out of "
                               "core, tensors are read from disk, computed there and written back; in memory, the "
                               "models are loaded there", "where to compute: 'cpu', 'cuda' or 'cuda:N'",
                               metavar="DEV")
    memory_budget: StrictStr | None = _field(
        None, "bytes the out-of-core engine may hold at once (its caches, a pass of statistics, a group's working "
        "copies), e.g. 2GB; default: fixed sizes of about 0.5 GB",
        f"a size such as '2GB' or '500MB', above 0 and at most {MAX_BUDGET // 10 ** 9}GB", metavar="SIZE")
    max_shard_size: StrictStr | None = _field(
        None, "largest file of the merged checkpoint, e.g. 2GB; default: a sharded anchor's largest shard, so the "
        "output is sharded like the input (else 2 GiB)", "a size such as '2GB' or '500MB'", metavar="SIZE")
    force: StrictBool = _field(False, "replace an existing --out (a previous symgraph output)", "true or false")

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
                                 "or '500MB' (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; a bare number is bytes)")
        return v

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v):
        return usable_device(v)

    @field_validator("align", mode="before")
    @classmethod
    def _no_yaml_booleans(cls, v):
        if isinstance(v, bool) or v is None:
            raise ValueError(f"is the YAML value {v!r} (YAML reads no/off/false as a boolean); write "
                             "'none' in quotes, or 'weights' / 'activations'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _learned_from_activations(cls, fields, info):
        """Learned matching starts from activation matching: ``refine`` without ``align`` aligns by them."""
        learned = isinstance(fields, dict) and fields.get("refine") and "align" not in fields
        return {**fields, "align": "activations"} if learned and not (info.context or {}).get("fields_only") else fields

    @model_validator(mode="after")
    def _consistent(self, info):
        """The rules between fields (:func:`check`), named as the context's ``name(key)`` says
        (default: the flags); context ``fields_only`` (a YAML file the command line will
        complete) skips them, ``batches``: data come as batches already loaded."""
        ctx = info.context or {}
        if not ctx.get("fields_only"):
            check(self.model_dump(), ctx.get("name") or (lambda k: flag(MergeConfig, k)), ctx.get("batches", False))
        return self

    @property
    def takes_statistics(self) -> bool:
        """Whether a step of the merge takes statistics on its data: activation matching (learned
        matching's start too), REPAIR, or the method's own (``seen_rows`` only reads which tokens occur)."""
        return self.align == "activations" or self.repair or get_method(self.method).needs_data

    @property
    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes, as its validator read it (None: the engine's fixed sizes)."""
        return None if self.memory_budget is None else parse_size(self.memory_budget)

    @property
    def shard_bytes(self) -> int | None:
        """``max_shard_size`` in bytes, as its validator read it (None: the caller's default)."""
        return None if self.max_shard_size is None else parse_size(self.max_shard_size)

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


def check(opts: dict, name, batches: bool = False) -> None:
    """The checks between options the schema accepted, the config's validator; ``name(key)``
    says where an option came from in a refusal (``--refine``, ``'refine:' in merge.yaml``);
    ``batches``: the data come as batches already loaded, not as ``data``."""
    n = name
    data = f"{n('data')} FILE" if n("data").startswith("--") else n("data")
    opts = {**opts, "data": opts["data"] or batches}
    if opts["refine"] and not opts["data"]:
        raise InputError(f"{n('refine')} needs {data} (batches for activation matching and the loss)")
    if opts["refine"] and opts["align"] != "activations":  # no align given: activations (the validator's)
        a = n("align") if n("align").startswith("--") else "align"
        raise InputError(f"{n('refine')} starts from activation matching, and {n('align')} says {opts['align']}; "
                         f"expected {a} activations")
    if opts["weights"] is not None:
        mixing_weights(opts["weights"], len(opts["models"]))
    if opts["attention"] == "circuits" and (opts["method"] != "average" or opts["repair"]):
        raise InputError(f"{n('attention')} circuits merges by averaging; expected {n('method')} average without "
                         f"{n('repair')}")
    if opts["seen_rows"] and not opts["data"]:
        raise InputError(f"{n('seen_rows')} reads the embedding rows of the tokens in the data; expected {data}")
    for key, what in (("sketch", "sketches"), ("tol", "ends the sweeps of"), ("seen_rows", "restricts")):
        if opts[key] and opts["align"] != "weights":
            raise InputError(f"{n(key)} {what} weight matching; expected {n('align')} weights")
    sweeps = "ends the sweeps of an alignment"
    for key, what in (("max_iter", sweeps), ("until", sweeps), ("full_groups", "fits the groups an alignment solves")):
        if opts[key] != AlignOptions.model_fields[key].default and opts["align"] in ("none", None):
            raise InputError(f"{n(key)} {what}; expected {n('align')} weights or activations")
    anchor, count = opts["anchor"], len(opts["models"])
    if anchor == "universe" and (opts["align"] in ("none", None) or opts["attention"] == "circuits"):
        raise InputError(f"{n('anchor')} universe aligns every model to the mean of the others; expected "
                         f"{n('align')} weights or activations, with {n('attention')} heads")
    if anchor != "universe" and not 0 <= anchor < count:
        raise InputError(f"{n('anchor')} {anchor} is not one of the {count} models; expected an index 0..{count - 1} "
                         "or universe")
    if opts["repair"] and not opts["data"]:
        raise InputError(f"{n('repair')} needs {data} (batches to measure activation statistics on)")
    needs_data = get_method(opts["method"]).needs_data or opts["align"] == "activations"
    if needs_data and not opts["data"]:
        raise InputError(f"{n('align')} {opts['align']} with {n('method')} {opts['method']} needs {data} (a "
                         ".safetensors or .pt file with a tensor 'input_ids' [N, S]); expected it, or "
                         f"{n('align')} weights/none with {n('method')} average")


def solver_options(config) -> dict:
    """The alignment options ``config`` sets that reach the solver, in memory and out of core
    alike (weight matching's ``sketch``, ``tol``, ``max_iter``, ``until``; ``full_groups``);
    unset ones keep :func:`symgraph.align`'s defaults."""
    return {k: getattr(config, k) for k in ("sketch", "tol", "max_iter", "until", "full_groups") if getattr(config, k)}


def engine_config(sources, config, options: dict, data, method=None) -> tuple:
    """``(config, align_options)`` for the merge engine over ``sources``: ``config`` as given, or
    built from keyword ``options`` (``align=None`` for ``"none"``, ``method_options`` for
    ``parameters``, sizes and devices as numbers and ``torch.device`` s) by the same rules,
    ``data`` standing for the data file; options the config does not hold go to the alignment.
    ``method``: a method instance the config's ``method`` stands for."""
    options = dict(options)
    if config is not None:
        return config, options
    fields = {k: options.pop(k) for k in list(options) if k in MergeConfig.model_fields}
    if "method_options" in options:
        given = options.pop("method_options")
        if given is not None and not isinstance(given, dict):
            raise InputError(f"method_options is a {type(given).__name__}; expected a dict of the method's parameters")
        fields["parameters"] = dict(given or {})
    if fields.get("align", "weights") is None:
        fields["align"] = "none"
    for k in ("memory_budget", "max_shard_size"):
        if isinstance(fields.get(k), int) and not isinstance(fields[k], bool):
            fields[k] = f"{fields[k]}B"
    if "device" in fields:
        fields["device"] = str(fields["device"])
    from .methods.registry import MergeMethod
    if method is not None and not isinstance(method, (str, MergeMethod)):
        raise InputError(f"method={method!r}; expected a registered method's name ({', '.join(merge_methods())}) "
                         "or a MergeMethod instance")
    if method is not None and not isinstance(method, str):  # an instance: its parameters are its own
        fields["method"] = method.name if method.name in merge_methods() else "average"
        fields.pop("parameters", None)
    elif method is not None:
        fields["method"] = method
    fields["models"] = [str(getattr(s, "path", None) or s) for s in sources]
    try:
        return MergeConfig.model_validate(fields, context={"batches": bool(data), "name": _keyword}), options
    except ValidationError as e:
        raise InputError(refused(e, fields, _keyword, MergeConfig)) from None


def _keyword(key: str) -> str:
    """How a refusal names option ``key`` given as a Python keyword (``method_options`` for the
    config's ``parameters``)."""
    return "method_options" if key == "parameters" else key

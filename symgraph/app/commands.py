"""The options of ``symgraph align``, ``barrier`` and ``compare``: one frozen pydantic schema per
command (:data:`AlignCommand`, :data:`BarrierCommand`, :data:`CompareCommand`).

Every option a command shares with ``symgraph merge`` is :class:`~symgraph.merging.config.MergeConfig`'s
own declaration of it: its type and range, default, description (a command may say it in its own
words), what a refusal expects and its validators (a size, a device), so the flags
(:func:`~symgraph.app.options.add_flags`), the defaults and the one-line refusals are merge's.
A command declares only its own options (``barrier --points``, ``compare --null``); where one
differs from merge's, its field says so (``barrier --align`` takes several alignments, ``align
--align`` no ``none``). The rules between options are the schema's validator: merge's
(:func:`~symgraph.merging.config.check`: "sketch sketches weight matching", ...) for the
alignment the command runs, and the command's own. :func:`read_command` reads a command line's
values back (argparse's namespace) and validates them: a refusal is one
:class:`~symgraph.errors.InputError` line, worded as ``symgraph merge`` words it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, ValidationError, create_model, field_validator,
                      model_validator)

from ..alignment.compare import NULL_DRAWS
from ..core.schema import SEED, expected, flag
from ..errors import InputError
from ..evaluation.barrier import MAX_POINTS
from ..merging.config import MergeConfig, check, refused
from .options import given_options

__all__ = ["AlignCommand", "BarrierCommand", "CompareCommand", "Command", "read_command", "shared",
           "engine_options", "engine_given", "ENGINE_ONLY"]

#: The options only the out-of-core engine takes: given to ``barrier`` or ``compare``, they run it.
ENGINE_ONLY = ("device", "memory_budget")
#: ``--device`` of a command whose alignment is the out-of-core engine's (in memory it refuses one).
DEVICE = ("compute the alignment on this device (cpu, cuda, cuda:N; like mergekit's --cuda): the out-of-core "
          "engine reads tensors from disk, computes there and writes back")
#: The alignment options that reach the solver (:func:`~symgraph.merging.config.solver_options`'s).
SOLVER = ("sketch", "tol", "max_iter", "until", "full_groups")


def shared(key: str, description: str | None = None, required: bool = False) -> tuple:
    """``(annotation, field)`` of :class:`MergeConfig`'s field ``key``: its type with its range,
    its default (none when ``required``), its description (unless the command words it itself)
    and its extra declaration (what a refusal expects, the metavar)."""
    f = MergeConfig.model_fields[key]
    parts = (f.annotation, *f.metadata)  # the type and its range (``Ge``, ``Le``, ``Strict``)
    annotation: Any = Annotated[parts] if f.metadata else f.annotation  # type: ignore[valid-type]
    return annotation, Field(... if required else f.default, description=description or f.description,
                             json_schema_extra=dict(f.json_schema_extra or {}))  # type: ignore[arg-type]


def _validators(keys) -> dict:
    """:class:`MergeConfig`'s field validators of ``keys`` (a size, a device), for a command's schema."""
    out = {}
    for name, d in MergeConfig.__pydantic_decorators__.field_validators.items():
        fields = [k for k in d.info.fields if k in keys]
        if fields:
            out[name] = field_validator(*fields, mode=d.info.mode)(getattr(d.func, "__func__", d.func))
    return out


def _own(annotation, default, description: str, wanted: str, metavar: str | None = None,
         flag: str | None = None) -> tuple:
    """A command's own option: its type and range, default, help and what a refusal expects
    (``flag``: when the command line does not spell it ``--key``)."""
    extra = {"expected": wanted, **({"metavar": metavar} if metavar else {}), **({"flag": flag} if flag else {})}
    return annotation, Field(default, description=description, json_schema_extra=extra)  # type: ignore[arg-type]


class Command(BaseModel):
    """A command's options (see the module docstring): frozen, no unknown option."""
    model_config = ConfigDict(extra="forbid", frozen=True)


def _command(name: str, doc: str, rules, keys: tuple, own: dict, words: dict | None = None) -> type:
    """A command's schema: merge's fields ``keys`` (``words``: ``{key: description}`` a command
    says in its own words) after the command's ``own`` fields, with merge's validators of them
    and the command's ``rules`` between them."""
    words = words or {}
    fields = {k: own[k] if k in own else shared(k, words.get(k)) for k in keys}  # the flags' order
    validators = {**_validators(keys), "rules": model_validator(mode="after")(rules)}
    return create_model(name, __base__=Command, __doc__=doc, __validators__=validators, **fields)  # type: ignore


def _merge_rules(cmd, align: str) -> None:
    """Merge's rules between options (:func:`check`) on the command's values, for ``align``
    (options a command has not: merge's defaults)."""
    opts = {k: f.default for k, f in MergeConfig.model_fields.items()} | {"models": ["A", "B"]}
    mine = type(cmd).model_fields
    opts |= {k: getattr(cmd, k) for k in mine if k in opts} | {"align": align}
    check(opts, lambda k: flag(type(cmd) if k in mine else MergeConfig, k))


def _align_rules(self):
    if self.align == "activations" and not self.data:
        raise InputError(f"--align activations needs --data FILE; expected {expected(MergeConfig, 'data')}")
    _merge_rules(self, self.align)
    return self


AlignCommand = _command(
    "AlignCommand", "The options of ``symgraph align A B``: B written in A's basis.", _align_rules,
    ("align", "out", "data", "fold_norms", "outputs", "device", "memory_budget") + SOLVER + ("force",),
    {"align": _own(Literal["weights", "activations"], "weights",
                   "how B is put into A's basis: by weights (data-free) or by activations (needs --data)",
                   "one of 'weights', 'activations' (an alignment to save)"),
     "out": shared("out", required=True)},
    {"device": DEVICE})


def _barrier_rules(self):
    if self.align_data is not None and "activations" not in self.align:
        raise InputError("--align-data is the data of activation matching; expected --align with activations")
    core = engine_given(self) + (["--out-of-core"] if self.out_of_core else [])
    if core and self.attention == "circuits":
        raise InputError(f"--attention circuits draws the line in memory, and {' and '.join(core)} run(s) it out of "
                         f"core; expected --attention heads, or no {' or '.join(core)}")
    _merge_rules(self, "weights" if "weights" in self.align else max(self.align, key=lambda a: a != "none"))
    return self


BarrierCommand = _command(
    "BarrierCommand", "The options of ``symgraph barrier A B``: the loss along the line between them.",
    _barrier_rules,
    ("data", "align_data", "align", "attention", "points", "fold_norms", "device", "memory_budget") + SOLVER
    + ("out_of_core", "out", "force"),
    {"data": shared("data", ".safetensors/.pt with 'input_ids' [N, S]: the loss is measured on it", required=True),
     "align_data": shared("data", "batches for activation matching (default: --data; the loss is always on "
                          "--data)"),
     "align": _own(Annotated[list[Literal["none", "weights", "activations"]], Field(min_length=1)],
                   ["none", "weights", "activations"], "the alignments to compare (sketch and tol: the weights "
                   "row's)", "one or more of 'none', 'weights', 'activations'"),
     "points": _own(Annotated[int, Field(strict=True, ge=3, le=MAX_POINTS)], 11, f"values of λ, 3 to {MAX_POINTS}",
                    f"at least 3 and at most {MAX_POINTS} values of λ (the ends and a middle)", "N"),
     "out_of_core": _own(StrictBool, False, "never load a model whole (the default only for models that would not "
                         "fit easily, or with --device or --memory-budget): slower, each point runs the model op by "
                         "op on tensors read from disk", "true or false")},
    {"attention": "circuits: the line in circuit space (heads N times as wide)", "device": DEVICE,
     "out": "write barrier.json and barrier.png into this new directory"})


def _compare_rules(self):
    if self.sketch and self.data is not None:
        raise InputError("--sketch sketches weight matching, and with --data compare aligns by activations; "
                         "expected no --data")
    return self


CompareCommand = _command(
    "CompareCommand", "The options of ``symgraph compare A B``: is B a copy of A, derived from it or unrelated?",
    _compare_rules,
    ("data", "null", "seed", "as_json", "fold_norms", "device", "memory_budget", "sketch", "out_of_core", "out",
     "force"),
    {"null": _own(NULL_DRAWS.annotation, 4, "shuffled copies of B aligned for the null (0: none, no p-value)",
                  NULL_DRAWS.expected, "N"),
     "seed": _own(SEED.annotation, 0, "seed of the shuffles", SEED.expected),
     "as_json": _own(StrictBool, False, "print the per-tensor numbers as JSON", "true or false", flag="--json"),
     "out_of_core": _own(StrictBool, False, "read two save_pretrained directories tensor by tensor, never a whole "
                         "model (default: when loading both would take over half the available memory, or with "
                         "--device, --memory-budget or --sketch)", "true or false")},
    {"data": ".safetensors/.pt with 'input_ids' [N, S]: align by activations (default: by weights)", "device": DEVICE,
     "out": "write compare.json and compare.png into this new directory"})


def read_command(args: dict, schema):
    """The options of ``schema`` a command line gave (argparse's namespace as a dict), validated
    whole: each by its declaration, then the rules between them; a refusal is one
    :class:`InputError` line, naming the flag as ``symgraph merge`` does."""
    given = given_options(args, schema)
    try:
        return schema.model_validate(given)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "missing":
            key = str(err["loc"][0])
            raise InputError(f"{flag(schema, key)} is required; expected {expected(schema, key)}") from None
        raise InputError(refused(e, given, lambda k: flag(schema, k), schema)) from None


def engine_options(cmd, how: str | None = None) -> dict:
    """The options of ``cmd`` that the merge engine (or :func:`symgraph.align`: without
    :data:`ENGINE_ONLY`) takes for an alignment ``how``: weight matching's sketch and tol only
    for weights; options at their default left out."""
    keys = [k for k in ("fold_norms", "outputs") + SOLVER + ENGINE_ONLY if k in type(cmd).model_fields]
    if how not in (None, "weights"):
        keys = [k for k in keys if k not in ("sketch", "tol")]
    return {k: getattr(cmd, k) for k in keys if getattr(cmd, k) != MergeConfig.model_fields[k].default}


def engine_given(cmd) -> list:
    """The flags of ``cmd`` that only the out-of-core engine takes, as given (none: in memory is fine)."""
    return [flag(type(cmd), k) for k in ENGINE_ONLY if getattr(cmd, k) != MergeConfig.model_fields[k].default]

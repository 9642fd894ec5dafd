"""One line for a value an options schema refuses: what every pydantic schema of symgraph
(:class:`~symgraph.alignment.options.AlignOptions`, :class:`~symgraph.app.config.MergeConfig`)
turns its ``ValidationError`` into, so that a refusal names the option, the value given and what
the option expects, in the schema's own words (each field's ``json_schema_extra["expected"]``)."""
from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Mapping

from pydantic import Field, StrictInt, TypeAdapter, ValidationError

__all__ = ["short_repr", "quoted", "expected", "error_key", "refusal", "refused", "Number", "SEED", "Option", "options", "flag",
           "UNSET", "Unset"]


def short_repr(v, n: int = 80) -> str:
    """``repr(v)`` on one line, cut to about ``n`` characters (a refusal is one line, whatever
    the file holds)."""
    r = repr(v)
    r = " ".join(r.split()) if "\n" in r else r
    return r if len(r) <= n else r[:n] + "..."


def quoted(e, n: int = 200) -> str:
    """A library's message (an exception, or its text) on one line, quoted in a refusal: its
    first sentences that fit in ``n`` characters, or its first ``n`` cut at a word (``...``
    marks the cut); the exception's type name when it says nothing."""
    s = " ".join(str(e).split()) or type(e).__name__
    if len(s) <= n:
        return s
    kept = ""
    for sentence in re.split(r"(?<=[.!?])\s+", s):
        if len(kept) + len(sentence) + 1 > n:
            break
        kept = f"{kept} {sentence}".strip()
    return kept or s[:n].rsplit(" ", 1)[0] + " ..."


def expected(schema, key: str, fallback: str = "a valid value") -> str:
    """What field ``key`` of the pydantic model ``schema`` expects (its ``expected`` extra)."""
    f = schema.model_fields.get(key)
    extra = f.json_schema_extra if f is not None else None
    return str(extra["expected"]) if isinstance(extra, dict) and "expected" in extra else fallback


def error_key(err: Mapping[str, Any]) -> str:
    """The top-level field one of pydantic's errors is about (``'?'`` for a model-level one)."""
    loc = err.get("loc") or ()
    return str(loc[0])[:80] if loc else "?"


def refusal(err: Mapping[str, Any], said: str, wanted: str) -> str:
    """One line for one of pydantic's errors (``ValidationError.errors()[0]``): ``said`` names the
    value where it was given (``tol=1.0 (float)``, ``--tol 1.0``, ``merge config 'm.yaml': key
    'tol' is 1.0 (float)``), ``wanted`` is what the field expects. A field validator's own
    message is kept (it says what it expects, or is put in brackets before ``wanted``); pydantic's
    generic wording ("Input should be ...") is left out: ``wanted`` says it for that field."""
    why = str(err.get("msg", "")).removeprefix("Value error, ")
    if err.get("type") == "value_error":
        return f"{said}: {why}" if "expected" in why else f"{said} ({why}); expected {wanted}"
    return f"{said}; expected {wanted}"


def refused(e, given: Mapping[str, Any], name, schema) -> str:
    """One line for the first error of a config's validation (``e``, pydantic's, of ``schema``):
    a field's names it and the value ``given`` (``name(key)``: a flag, or where a YAML file set
    it); a rule between fields (the model's validator) says it all."""
    err = e.errors()[0]
    if not err.get("loc"):  # the model's validator: its own line
        return str(err.get("msg", "")).removeprefix("Value error, ")
    key = error_key(err)
    if key not in schema.model_fields:
        return f"{key!r} is not a merge option; expected only {', '.join(schema.model_fields)}"
    return refusal(err, f"{name(key)} {short_repr(given.get(key))}", expected(schema, key))


class Number:
    """A numeric option a command declares outside a pydantic model (``demo --seconds``,
    ``compare --null``, a seed): its type and finite range as a pydantic annotation and what a
    refusal says is expected, declared once and checked by that declaration wherever the value
    enters (the command line names its flag, the Python API its keyword)."""

    def __init__(self, annotation, expected: str):
        self.annotation, self.expected = annotation, expected  # a schema's field may take both
        self.adapter = TypeAdapter(annotation)

    def check(self, value, said: str):
        """``value`` as the declaration reads it, or an :class:`~symgraph.errors.InputError` of one
        line naming the option where it was given (``said``: ``--seconds``, ``seconds=``) and its range."""
        from ..errors import InputError
        try:
            return self.adapter.validate_python(value)
        except ValidationError:
            raise InputError(f"{said} {short_repr(value)}; expected {self.expected}") from None


#: A random seed: every generator symgraph seeds (torch's, numpy's) takes it as it is.
SEED = Number(Annotated[StrictInt, Field(ge=0, le=2 ** 32 - 1)], "a seed, an integer from 0 to 2**32 - 1")


class Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


#: The default of a Python keyword whose default the schema holds (``symgraph.merge``'s ``align``):
#: a keyword left unset takes the schema's default, one given (its default value too) is checked.
UNSET: Any = Unset()


class Option(typing.NamedTuple):
    """One option as the command line sees it."""
    key: str          # the YAML key and the schema field
    metavar: str | None
    flag: str | None  # "--align", "--no-fold-norms"; None: YAML only
    kind: str         # "bool", "negated", "list", "choice", "int", "float", "str"
    choices: tuple
    element: type | None
    default: object
    help: str


def _kind(annotation):
    """(kind, choices, element type) of a field's annotation."""
    annotation = _base(annotation)  # Annotated[list[...], Field(min_length=1)] -> list[...]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "choice", tuple(typing.get_args(annotation)), None
    if origin in (typing.Union, types.UnionType):
        if all(typing.get_origin(a) is list for a in args):
            return _kind(args[0])
        if len(args) == 1:
            return _kind(args[0])
        if {_base(a) for a in args} <= {int, float}:
            return "float", (), None
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if words and {_base(a) for a in args if typing.get_origin(a) is not typing.Literal} == {int}:
            return "int_or_choice", tuple(words), int
    if origin is dict:
        return "mapping", (), None
    if origin is list:
        (inner,) = typing.get_args(annotation) or (str,)
        if typing.get_origin(inner) is typing.Literal:  # barrier --align none weights: one or more words
            return "list", tuple(typing.get_args(inner)), str
        el = _base(typing.get_args(inner)[0] if typing.get_origin(inner) is typing.Union else inner)
        return "list", (), el
    base = _base(annotation)
    return {bool: "bool", int: "int", float: "float"}.get(base, "str"), (), None


def _base(t):
    """The plain Python type behind pydantic's strict aliases (``StrictInt`` -> int)."""
    if typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    return t


def options(schema) -> list:
    """Every field of ``schema`` as an :class:`Option`."""
    out = []
    for key, f in schema.model_fields.items():
        extra = f.json_schema_extra or {}
        kind, choices, element = _kind(f.annotation)
        if kind == "bool" and f.default is True:
            kind = "negated"
        name = None if extra.get("cli") is False else extra.get("flag") or (
            "--no-" if kind == "negated" else "--") + key.replace("_", "-")
        out.append(Option(key, extra.get("metavar"), name, kind, choices, element, f.default, f.description or ""))
    return out


def flag(schema, key: str) -> str:
    """How the command line spells option ``key`` (``--refine``, ``--no-fold-norms``)."""
    return next(o.flag for o in options(schema) if o.key == key) or key

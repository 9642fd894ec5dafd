"""Everything a merge option is, derived from its one declaration in
:class:`~symgraph.app.config.MergeConfig`: a pydantic field whose ``description`` is its
help and YAML text and whose ``json_schema_extra`` says how the command line spells it
(``flag``; ``cli: False`` for the keys only a YAML file sets, such as ``models``).

- :func:`add_flags` adds the ``symgraph merge`` flags to an argparse parser;
- :func:`given_options` reads back the options a command line set (unset flags are None, so a
  YAML config's values stand);
- :func:`options_table` is the option table of the docs (YAML key, flag, default, meaning).
"""
from __future__ import annotations

import argparse

from pydantic_core import PydanticUndefined

from ..core.schema import Option, flag, options

__all__ = ["add_flags", "given_options", "options_table", "options_page", "flag", "Option"]


def add_flags(parser: argparse.ArgumentParser, schema, *, choices_for=None) -> None:
    """A flag for every command-line option of ``schema``; every default is None (unset), so
    the YAML config and then the schema's default decide. ``choices_for``: ``{key: choices}``
    known only at run time (the registered merge methods)."""
    for o in options(schema):
        if o.flag is None:
            continue
        dest = o.key
        required = o.default is PydanticUndefined  # a command's option without a default (align --out)
        default = o.default if not required and o.default not in (None, [], (), {}) else None
        shown = f" (default: {default})" if default is not None and o.kind not in ("bool", "negated") else ""
        text = f"switch off the default: {o.help}" if o.kind == "negated" else o.help  # says what it turns off
        kw = dict(dest=dest, default=None, help=text + shown, **({"required": True} if required else {}))
        if o.kind in ("bool", "negated"):
            kw["action"] = "store_const"
            kw["const"] = o.kind == "bool"
        elif o.kind == "list":
            kw.update(nargs="+", type=o.element or str, metavar=o.metavar or o.key.upper())
            if o.choices:  # a list of words (barrier --align none weights)
                kw.update(choices=o.choices, metavar=o.metavar)
        elif o.kind == "mapping":  # NAME=VALUE, the flag given once per name
            kw.update(action="append", metavar=o.metavar or "NAME=VALUE")
        elif o.kind == "int_or_choice":  # --anchor 2 or --anchor universe
            kw.update(type=_int_or_word, metavar=o.metavar or "|".join(("N",) + o.choices))
        elif o.kind == "choice":
            kw["choices"] = o.choices
        elif choices_for and o.key in choices_for:
            kw["choices"] = choices_for[o.key]
        else:
            kw["metavar"] = o.metavar or o.key.upper()
            if o.kind in ("int", "float"):
                kw["type"] = int if o.kind == "int" else float
        parser.add_argument(o.flag, **kw)


def given_options(args: dict, schema) -> dict:
    """``{key: value}`` of the options the command line set (argparse's namespace as a dict); a
    mapping option's ``NAME=VALUE`` words become a dict, each value read as a YAML scalar is."""
    out = {}
    for o in options(schema):
        if o.flag is not None and args.get(o.key) is not None:
            out[o.key] = _mapping(o.flag, args[o.key]) if o.kind == "mapping" else args[o.key]
    return out


def _int_or_word(text: str):
    """A command-line value that is a whole number (``2``, ``-1``) or a word (``universe``)."""
    return int(text) if text.lstrip("-").isdigit() else text


def _mapping(flag_name: str, words) -> dict:
    """``["alpha=0.1", ...]`` as ``{"alpha": 0.1}`` (a dict given in Python stays as it is)."""
    if isinstance(words, dict):
        return words
    from ..core.schema import short_repr
    from ..errors import InputError
    out: dict = {}
    for w in words:
        name, eq, text = str(w).partition("=")
        if not eq or not name.strip():
            raise InputError(f"{flag_name} {short_repr(w)} is not NAME=VALUE; expected e.g. {flag_name} alpha=0.1")
        if name.strip() in out:
            raise InputError(f"{flag_name} gives {name.strip()!r} twice; expected each name once")
        out[name.strip()] = _scalar(text.strip())
    return out


def _scalar(text: str):
    """A command-line value as YAML reads a scalar (``0.1``, ``1e-3``, ``true``, ``abc``)."""
    import yaml
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, str):
        try:
            return float(v)  # 1e-3: YAML 1.1 wants a dot, YAML 1.2 (and a merge config) does not
        except ValueError:
            return v
    return v if isinstance(v, (int, float, bool)) or v is None else text


def options_table(schema) -> str:
    """The docs' option table (markdown), one row per option."""
    rows = ["| YAML key | flag | default | meaning |", "|---|---|---|---|"]
    for o in options(schema):
        default = "(required)" if o.key == "models" else repr(o.default) if o.default is not None else "unset"
        spelled = f"`{o.flag}`" if o.flag else f"positional `{o.metavar}`" if o.metavar else "(YAML only)"
        rows.append(f"| `{o.key}` | {spelled} | `{default}` | {o.help} |")
    return "\n".join(rows)


def options_page(schema) -> str:
    """``docs/options.md``: the option table with how to regenerate it."""
    return ("# Merge options\n\nEvery option of `symgraph merge`, as a YAML key of `--config` and as a flag "
            "(the flag wins). Generated from `symgraph.app.config.MergeConfig` by "
            "`python -m symgraph.app.config > docs/options.md`; never edited by hand.\n\n"
            + options_table(schema) + "\n")


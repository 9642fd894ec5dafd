"""``docs/cli.md``: every ``symgraph`` subcommand and its options, generated from the argparse
parsers of :func:`symgraph.cli.main.build_parser` (``python -m symgraph.cli.reference >
docs/cli.md``), so the page cannot drift from the command."""
from __future__ import annotations

import argparse

__all__ = ["cli_page"]

_HEAD = """# Command line

Every `symgraph` subcommand and its options. Generated from the command's own parsers by
`python -m symgraph.cli.reference > docs/cli.md`; never edited by hand (a test compares them).
`symgraph -h` and `symgraph COMMAND -h` print the same text in the terminal; `python -m symgraph`
is the same command as `symgraph`.

Every command refuses bad input with one paragraph on stderr (what was wrong, what was expected)
and exit code 2, writing nothing; `--debug` (before or after the subcommand) shows the traceback
instead. Ctrl-C ends with exit code 130, SIGTERM with 143, and a closed output pipe (`| head`)
quietly with 141. See [troubleshooting](troubleshooting.md) for the refusals and what to do. The options of
`symgraph merge` are also YAML keys of `--config`: see [merge options](options.md).

Steps that take a while show progress bars on stderr when it is a terminal (alignment per unit
and sweep, statistics per batch, REPAIR, writing, the barrier per point, compare per null draw;
`SYMGRAPH_PROGRESS=1` shows them anywhere); `--quiet` (before or after the subcommand) turns
them off, and every note and warning of ours with them (a refusal still shows). `symgraph
--version` prints the version.
"""


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _sentence(text) -> str:
    text = _cell(text).rstrip(".")
    return text[:1].upper() + text[1:] + "."


def _spelling(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest}" + (" ...`" if a.nargs in ("*", "+") else "`")
    flags = ", ".join(a.option_strings)
    if a.nargs == 0:
        return f"`{flags}`"
    if a.choices is not None:
        return f"`{flags} {{{','.join(map(str, a.choices))}}}`"
    meta = a.metavar or a.dest.upper()
    return f"`{flags} {meta}" + (" ...`" if a.nargs in ("*", "+") else "`")


def _default(a: argparse.Action) -> str:
    if a.required and a.option_strings:
        return "required"
    if a.nargs == 0 or a.default in (None, argparse.SUPPRESS):
        return ""
    return f"`{a.default}`"


def _table(parser: argparse.ArgumentParser) -> list:
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for a in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's arguments
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:  # noqa: SLF001
            continue
        if a.dest == "debug":
            continue  # the same everywhere: said once above
        rows.append(f"| {_spelling(a)} | {_default(a)} | {_cell(a.help or '')} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    fmt = argparse.HelpFormatter(parser.prog, width=100)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)  # noqa: SLF001
    return fmt.format_help().strip()


def cli_page() -> str:
    """The markdown of ``docs/cli.md``."""
    from .main import build_parser
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    helps = {c.dest: c.help for c in sub._choices_actions}  # noqa: SLF001
    out = [_HEAD, "| command | what it does |", "|---|---|"]
    out += [f"| [`symgraph {name}`](#symgraph-{name}) | {_cell(helps.get(name, ''))} |" for name in sub.choices]
    for name, parser in sub.choices.items():
        out += ["", f"## symgraph {name}", "", _sentence(helps.get(name, "")), "",
                "```text", _usage(parser), "```", ""]
        out += _table(parser)
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python -m symgraph.cli.reference > docs/cli.md
    print(cli_page(), end="")

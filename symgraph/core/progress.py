"""Progress bars: tqdm on stderr for every step that can take a while (alignment per unit and
sweep, statistics per batch, REPAIR, writing, the barrier per point, compare per null draw).

Bars are shown only where someone watches: on a terminal (tqdm's own check of stderr), or
anywhere with ``SYMGRAPH_PROGRESS=1`` (forced, e.g. to record a run); never with
``SYMGRAPH_PROGRESS=0`` or ``symgraph --quiet`` (:func:`configure`). The steps deep in the
engine show theirs when the command line (or :func:`configure`) turns them on; a library call
that asks for ``progress=True`` shows its own bars as it always has.

``--quiet`` silences our notes and warnings too: every line on stderr that begins with one of
:data:`NOTE_PREFIXES` is written by :func:`note`, which drops it (a test keeps any other writer
of them out of the package), and Python warnings, for as long as :func:`silenced` holds
(``symgraph``'s ``main`` holds it around every command). A refusal (exit 2, one line) is never
silenced."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

__all__ = ["bar", "configure", "quiet", "note", "silenced", "NOTE_PREFIXES"]

#: ``[active, quiet]``: whether the engine's deep bars show, and whether ``--quiet`` was given.
_STATE = [False, False]
#: How our notes and warnings on stderr begin (what ``--quiet`` silences besides the bars).
NOTE_PREFIXES = ("symgraph: note:", "symgraph: warning:")


def configure(*, active: bool, quiet: bool = False) -> None:
    """Turn the engine's deep bars on or off (``active``) and every bar, note and warning off
    (``quiet``: ``--quiet``)."""
    _STATE[0], _STATE[1] = active, quiet


def quiet() -> bool:
    """Whether every bar is off: ``--quiet`` or ``SYMGRAPH_PROGRESS=0``."""
    return _STATE[1] or os.environ.get("SYMGRAPH_PROGRESS") == "0"


def note(message: str, kind: str = "note") -> None:
    """``symgraph: note: MESSAGE`` (``kind="warning"``: ``symgraph: warning: ...``) on stderr,
    unless ``--quiet``."""
    if not _STATE[1]:
        print(f"symgraph: {kind}: {message}", file=sys.stderr)


@contextlib.contextmanager
def silenced():
    """While held and ``--quiet`` was given (:func:`configure`): Python warnings are dropped
    (:func:`note` drops our own notes and warnings itself); everything else on stderr passes.
    Without ``--quiet``: nothing changes."""
    if not _STATE[1]:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def bar(iterable=None, *, enabled: bool | None = None, **kw):
    """A tqdm bar on stderr (a plain pass-through when off). ``enabled``: the caller's own
    ``progress`` flag; None for a deep step, shown when :func:`configure` made them active."""
    from tqdm import tqdm
    on = (_STATE[0] if enabled is None else bool(enabled)) and not quiet()
    disable = True if not on else (False if os.environ.get("SYMGRAPH_PROGRESS") == "1" else None)
    kw.setdefault("leave", False)
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, disable=disable, **kw)

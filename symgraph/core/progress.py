"""Progress bars: tqdm on stderr for every step that can take a while (alignment per unit and
sweep, statistics per batch, REPAIR, writing, the barrier per point, compare per null draw).

Bars are shown only where someone watches: on a terminal (tqdm's own check of stderr), or
anywhere with ``SYMGRAPH_PROGRESS=1`` (forced, e.g. to record a run); never with
``SYMGRAPH_PROGRESS=0`` or ``symgraph --quiet`` (:func:`configure`). The steps deep in the
engine show theirs when the command line (or :func:`configure`) turns them on; a library call
that asks for ``progress=True`` shows its own bars as it always has."""
from __future__ import annotations

import os
import sys

__all__ = ["bar", "configure", "quiet"]

#: ``[active, quiet]``: whether the engine's deep steps show bars, and whether every bar is off.
_STATE = [False, False]


def configure(*, active: bool, quiet: bool = False) -> None:
    """Turn the engine's deep bars on or off (``active``) and every bar off (``quiet``)."""
    _STATE[0], _STATE[1] = active, quiet


def quiet() -> bool:
    """Whether every bar (and note) is off: ``--quiet`` or ``SYMGRAPH_PROGRESS=0``."""
    return _STATE[1] or os.environ.get("SYMGRAPH_PROGRESS") == "0"


def bar(iterable=None, *, enabled: bool | None = None, **kw):
    """A tqdm bar on stderr (a plain pass-through when off). ``enabled``: the caller's own
    ``progress`` flag; None for a deep step, shown when :func:`configure` made them active."""
    from tqdm import tqdm
    on = (_STATE[0] if enabled is None else bool(enabled)) and not quiet()
    disable = True if not on else (False if os.environ.get("SYMGRAPH_PROGRESS") == "1" else None)
    kw.setdefault("leave", False)
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, disable=disable, **kw)

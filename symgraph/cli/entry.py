"""The ``symgraph`` console script (``[project.scripts]``) and ``python -m symgraph``.

Loading the command imports torch and transformers (seconds). A Ctrl-C during that ends with
one line and exit code 130, not a traceback: this module, ``symgraph`` and ``symgraph.cli`` import
nothing heavy, so the ``try`` below is in place before the slow imports start."""
from __future__ import annotations

import sys

__all__ = ["main"]

EXIT_INTERRUPTED = 130


def main() -> None:
    try:
        from .main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("symgraph: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(run())

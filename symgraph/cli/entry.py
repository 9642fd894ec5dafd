"""The ``symgraph`` console script (``[project.scripts]``) and ``python -m symgraph``.

Loading the command imports torch and transformers (seconds). A Ctrl-C during that ends with
one line and exit code 130, not a traceback: this module, ``symgraph`` and ``symgraph.cli`` import
nothing heavy, so the ``try`` below is in place before the slow imports start."""
from __future__ import annotations

import os
import sys

__all__ = ["main"]

EXIT_INTERRUPTED = 130


def main() -> None:
    # PyTorch's CPU allocator asks for transparent huge pages for its large blocks (read once,
    # at its first allocation): the merge allocates and fills tensors of tens of MB by the
    # thousand (4 KiB page faults: 2-11% of a 4-layer 1.1B merge on 2 cores, 19 -> 10 ms a
    # fresh 46 MB tensor filled). The user's own setting stands; without THP the advice is a no-op.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        from .main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("symgraph: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(run())

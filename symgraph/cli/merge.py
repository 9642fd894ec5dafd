"""``symgraph merge``: parse, build the one :class:`~symgraph.app.config.MergeConfig`, call
:func:`~symgraph.app.run.run_merge`, print what was written."""
from __future__ import annotations


def cmd_merge(args) -> int:
    from ..app.config import merge_options
    from ..app.run import run_merge
    from ..core.progress import quiet
    cfg = merge_options(vars(args))
    print(run_merge(cfg, progress=not quiet()).summary(cfg))
    return 0

"""``symgraph merge``: parse, build the one :class:`~symgraph.merging.config.MergeConfig`, call
:func:`~symgraph.merging.run.run_merge`, print what was written."""
from __future__ import annotations


def cmd_merge(args) -> int:
    from ..merging.config import merge_options
    from ..merging.run import run_merge
    cfg = merge_options(vars(args))
    print(run_merge(cfg, progress=True).summary(cfg))
    return 0

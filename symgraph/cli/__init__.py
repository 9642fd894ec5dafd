"""The ``symgraph`` command: ``main`` (parsing, refusals, analyze/resize), ``merge`` (the merge
command over :func:`symgraph.app.run.run_merge`), ``demo`` and ``examples``."""

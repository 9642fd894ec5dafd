"""The ``symgraph`` command, thin over the library.

- ``main``       the parser, refusals as one line (exit 2), ``analyze`` and ``resize``
- ``entry``      the console script and ``python -m symgraph``
- ``merge``      ``symgraph merge`` over :func:`symgraph.app.run.run_merge`
- ``align``      ``symgraph align`` / ``apply``: B carried into A's basis
- ``barrier``    ``symgraph barrier``: the loss along the path between two models
- ``compare``    ``symgraph compare``: copy, derived or unrelated (provenance)
- ``rotate``     ``symgraph rotate``: a checkpoint rotated for quantization
- ``data``       ``symgraph data``: a data file from text with a tokenizer
- ``demo``       ``symgraph demo``: two tiny GPT-2s trained and merged
- ``examples``   report and certify a built-in tiny model
- ``coverage``   the ops of a traced model that have no rule
- ``reference``  ``docs/cli.md`` generated from the parsers
"""

"""The application layer: what the command line and YAML files give, turned into the one
:class:`~symgraph.merging.config.MergeConfig` and run.

- ``config``           YAML configs read (sizes and nesting bounded, paths relative to the file),
  the command line's options over them: :func:`~.config.merge_options`, ``build_config``, ``to_yaml``
- ``options``          the ``symgraph merge`` flags, the options read back and the docs' table,
  derived from the config's fields
- ``commands``         the options of ``symgraph align``, ``barrier`` and ``compare``: a schema each,
  sharing merge's fields (flags, defaults and refusals as merge's)
- ``mergekit_config``  mergekit configs (``merge_method: linear``) read as symgraph's
- ``run``              :func:`~.run.run_merge`, the one merge entry of a config, as its steps: inputs
  checked, the merge done out of core or in memory, then recorded and written atomically by one
  step for both paths; and ``merge_checkpoints``
- ``record``           what a merge records beside the model: ``symgraph_merge.json`` and the card
- ``carry``            B written in A's basis as a standard checkpoint (``symgraph align``/``apply``)
  by :func:`~.carry.carry_writer`, the one writer of a checkpoint moved by group elements
  (``symgraph rotate``'s too)
"""

"""Changing a model's width.

- ``resize``  :func:`~.resize.resize`: permutation classes made wider or narrower (optimal transport)
- ``widen``   a model's own traced program with some classes resized (circuit-space heads of a
  model whose config cannot state them)
- ``heads``   a model class built from a config that states heads ``n`` times as wide
  (circuit-space heads of a model whose config can state them)
"""

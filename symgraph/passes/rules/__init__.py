"""Per-op rules, one file per op family; importing a file registers its rules.

- ``matrix``      contractions: linear layers, matrix products, embeddings, convolutions
- ``attention``   ``scaled_dot_product_attention``
- ``pointwise``   elementwise ops (broadcast)
- ``reductions``  reductions and normalisations over an axis
- ``pooling``     ops acting on trailing spatial axes alike: pooling, padding, upsampling
- ``segments``    ops that cut an axis into segments or pick entries of it
- ``views``       ops that move, split or merge axes without touching values
"""
from . import attention, matrix, pointwise, pooling, reductions, segments, views  # noqa: F401

"""Per-op rules, one file per op family; importing a file registers its rules."""
from . import attention, matrix, pointwise, pooling, reductions, segments, views  # noqa: F401

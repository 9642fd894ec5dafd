"""Where the merge engine's tensors go besides a checkpoint directory
(:class:`~symgraph.checkpoints.sharded.CheckpointWriter`): a function that takes each merged
tensor (:class:`Into`: a merge of models in memory fills its model with them)."""
from __future__ import annotations

from .views import nbytes

__all__ = ["Into"]


class Into:
    """A writer into a function ``add(key, tensor)``
    (:meth:`~symgraph.merging.streaming.StreamingMerge.write_into`), counting what it was given."""

    def __init__(self, add):
        self.add_fn, self.tensors, self.bytes = add, 0, 0

    def add(self, key, t):
        self.add_fn(key, t)
        self.tensors, self.bytes = self.tensors + 1, self.bytes + nbytes(t)

    def close(self) -> dict:
        return {"tensors": self.tensors, "bytes": self.bytes, "shards": 0}

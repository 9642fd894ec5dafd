"""Where the merge engine's tensors go besides the output shards
(:class:`~symgraph.checkpoints.sharded.ShardWriter`): a function that takes each merged tensor
(:class:`Into`: a merge of models in memory fills its model with them), and the output's
``config.json`` and :data:`EXTRA_FILES` (:func:`write_config`)."""
from __future__ import annotations

import json
import os
import shutil

from .views import nbytes

__all__ = ["Into", "write_config", "EXTRA_FILES"]

#: Files of the anchor's directory copied beside the output's ``config.json``.
EXTRA_FILES = ("generation_config.json",)


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


def write_config(source_dir: str, directory: str, updates: dict | None, dtypes=()) -> None:
    """The anchor's ``config.json`` (from ``source_dir``) into ``directory``, with the fields the
    merge changes (``updates``; a dict value updates a nested config such as ``text_config``),
    and its :data:`EXTRA_FILES`. ``dtypes``: the written tensors' (``torch.float32``, ...); a
    ``dtype`` or ``torch_dtype`` the config states that none of them has is stale (transformers
    loads by it: ``float8_e4m3fn`` over float32 tensors cannot load) and becomes their most
    common floating-point dtype (the first by name on a tie). A checkpoint of mixed dtypes keeps a dtype it has."""
    for fn in EXTRA_FILES:
        if os.path.isfile(os.path.join(source_dir, fn)):
            shutil.copy2(os.path.join(source_dir, fn), os.path.join(directory, fn))
    src, dst = os.path.join(source_dir, "config.json"), os.path.join(directory, "config.json")
    with open(src, encoding="utf-8") as f:
        config = json.load(f)
    floats = [str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point]
    updates = {**(updates or {}), **{k: max(sorted(set(floats)), key=floats.count) for k in ("dtype", "torch_dtype")
                                     if floats and k in config and config[k] not in floats}}
    if not updates:
        shutil.copy2(src, dst)
        return
    for k, v in updates.items():
        config[k] = {**config[k], **v} if isinstance(v, dict) and isinstance(config.get(k), dict) else v
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

"""Page-cache control of checkpoint files and the read-throughput loop."""
from __future__ import annotations

import os
import time

from .checkpoints import weight_files
from .common import GB


def drop_cache(paths) -> None:
    """Evict these files' pages from the page cache (``posix_fadvise(DONTNEED)``; only clean
    pages go, so dirty ones are flushed first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths) -> None:
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def read_all(path) -> dict:
    """Read every tensor of a checkpoint with ``safe_open(..., framework="pt")``, one at a time,
    each copied into a fresh tensor (safetensors may return tensors backed by its mmap, whose
    pages are read only when touched)."""
    import torch  # noqa: F401 - imported before the clock starts (safetensors imports it lazily)
    from safetensors import safe_open
    n = nbytes = 0
    t = time.perf_counter()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                x = h.get_tensor(k).clone()  # get_tensor may hand back an mmap view; clone reads it
                nbytes += x.numel() * x.element_size()
                n += 1
                del x
    s = time.perf_counter() - t
    return {"tensors": n, "bytes": nbytes, "seconds": s, "gb_per_s": nbytes / GB / s if s else None}

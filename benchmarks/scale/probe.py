"""What a measured run in this process reads, solves and holds (:mod:`benchmarks.bench_device_disk`):
the inputs' share in the page cache, the memory's state, and :class:`Probe`."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..bench_cost import Counter

GB = 1e9


def resident(files) -> float | None:
    """The share of these files' pages in the page cache (``mincore``), None where it fails."""
    libc, have, total = ctypes.CDLL(None, use_errno=True), 0, 0
    try:
        for f in (f for f in files if os.path.getsize(f)):
            with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                start = ctypes.c_char.from_buffer(mm)
                vec = np.zeros((len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE, dtype=np.uint8)
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(len(mm)),
                                  vec.ctypes.data_as(ctypes.c_void_p))
                del start
            if rc:
                return None
            have, total = have + int((vec & 1).sum()), total + len(vec)
    except (OSError, ValueError, AttributeError):
        return None
    return have / total if total else None


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` memory field, bytes."""
    try:
        return next((int(ln.split()[1]) * 1024 for ln in Path("/proc/self/status").read_text().splitlines()
                     if ln.startswith(field + ":")), None)
    except OSError:
        return None


def _device(a, k) -> str:
    """The device type of the first tensor among a call's arguments (or in a list of them)."""
    t = next((x for x in [*a, *k.values(), *(y for x in a if isinstance(x, (list, tuple)) for y in x)]
              if isinstance(x, torch.Tensor)), None)
    return "none" if t is None else t.device.type


def _size(s) -> str:
    """A solve's size class: ``n=N`` from 1024 on (``N``: the smaller side), else ``n<1024``."""
    n = min(getattr(s, "shape", (0, 0))[-2:] or (0,))
    return f"n={n}" if n >= 1024 else "n<1024"


class Probe(Counter):
    """While a run lasts, counted as :class:`benchmarks.bench_cost.Counter` counts (no sync): the
    bytes read from checkpoints (``Checkpoint.read``), the device types of the similarities the
    unit solves are given, the calls of ``symgraph.solve._solvers``' ``hungarian`` and
    ``procrustes`` with their seconds by status and size (``n`` from 1024 on; smaller ones
    together); and the resident set's peak (``VmHWM`` reset through ``/proc/self/clear_refs``, else
    sampled every 0.2 s), the device's memory, and every ``every`` seconds ``beat(now())``."""

    def __init__(self, device, every: float = 0.0, beat=None):
        super().__init__()
        self.device, self.every, self.beat = device, every, beat
        self.rss_peak, self.hwm_reset, self._stop = 0, False, threading.Event()

    def __enter__(self):
        import symgraph.solve as S
        from symgraph.checkpoints.sharded import Checkpoint
        from symgraph.solve import _solvers as SV
        self.wrap(Checkpoint, "read", "read", lambda r, *a, **k: (None, 0.0, r.numel() * r.element_size(), None))
        for fn in ("solve", "nested_heads", "inner_blocks"):
            self.wrap(S, fn, fn, lambda r, *a, **k: (f"solver device: {_device(a, k)}", 0.0, 0.0, None))
        for fn in ("hungarian", "procrustes"):
            self.wrap(SV, fn, fn, lambda r, s, *a, fn=fn, **k: (f"{fn}: {r.status} [{_size(s)}]", 0.0, 0.0, None))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
            self.hwm_reset = True
        except OSError:
            pass
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        last = time.perf_counter()
        while not self._stop.wait(0.2):
            self.rss_peak = max(self.rss_peak, _status("VmRSS") or 0)
            if self.every and time.perf_counter() - last >= self.every:
                last = time.perf_counter()
                self.beat(self.now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.undo()
        self.rss_peak = max(self.rss_peak, (_status("VmHWM") if self.hwm_reset else None) or 0)
        return False

    @property
    def read(self) -> float:
        return self.rows.get("read", [0, 0, 0, 0])[3]

    @property
    def reads(self) -> int:
        return self.rows.get("read", [0])[0]

    @property
    def solver_devices(self) -> dict:
        return {k.removeprefix("solver device: "): v[0] for k, v in list(self.rows.items())
                if k.startswith("solver device: ")}

    def summary(self) -> dict:
        """The solver calls so far: ``{"hungarian: STATUS [n=N]": {"calls", "seconds"}}``."""
        return {k: {"calls": v[0], "seconds": round(v[1], 3)} for k, v in sorted(list(self.rows.items()))
                if k.startswith(("hungarian", "procrustes"))}

    def now(self) -> dict:
        cuda = self.device.type == "cuda"
        return {"elapsed_s": time.perf_counter() - self.t0, "read_gb": self.read / GB,
                "rss_gb": (_status("VmRSS") or 0) / GB,
                "gpu_now_gb": torch.cuda.memory_allocated(self.device) / GB if cuda else None,
                "gpu_peak_gb": torch.cuda.max_memory_allocated(self.device) / GB if cuda else None,
                "solver_calls": self.summary()}


def meminfo(fields=("MemAvailable", "Cached", "Dirty", "Writeback")) -> dict:
    """These ``/proc/meminfo`` fields in GB (dirty pages of a pair just written are still being
    written back while a run reads it); empty where it cannot be read."""
    try:
        lines = [ln.partition(":") for ln in Path("/proc/meminfo").read_text().splitlines()]
        return {k.lower() + "_gb": int(v.split()[0]) * 1024 / GB for k, _, v in lines if k in fields}
    except (OSError, ValueError, IndexError):
        return {}

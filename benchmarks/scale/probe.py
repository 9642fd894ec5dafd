"""What a measured run in this process reads, solves on and holds: the inputs' share in the
page cache (``mincore``), bytes read from checkpoints, the devices the solvers see, the
resident set's and the device's peaks, and a heartbeat while it lasts
(:mod:`benchmarks.bench_device_disk`)."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

GB = 1e9


def resident(files) -> float | None:
    """The share of these files' pages in the page cache (``mincore``), None where it fails."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                 ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page, have, total = os.sysconf("SC_PAGE_SIZE"), 0, 0
        for f in files:
            size = os.path.getsize(f)
            if not size:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                rc = libc.mincore(addr, size, vec)
                libc.munmap(addr, size)
                if rc:
                    return None
                have += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                total += n
            finally:
                os.close(fd)
        return have / total if total else None
    except (OSError, AttributeError):
        return None


def _status(field: str) -> int | None:
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            if ln.startswith(field + ":"):
                return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return None


class Probe:
    """While a run lasts: bytes read from checkpoints, the device types of the solvers'
    similarities, the resident set's peak, the device's memory, and a heartbeat."""

    def __init__(self, name, device, every, beat):
        self.name, self.device, self.every, self.beat = name, device, every, beat
        self.read = self.reads = 0
        self.solver_devices: dict = {}
        self.rss_peak, self.t0, self._undo, self._stop = 0, 0.0, [], threading.Event()
        self.hwm_reset = False

    def _wrap(self, owner, attr, after):
        f = getattr(owner, attr)

        def shim(*a, **k):
            r = f(*a, **k)
            after(r, a, k)
            return r
        setattr(owner, attr, shim)
        self._undo.append((owner, attr, f))

    def __enter__(self):
        import symgraph.solve as S
        from symgraph.checkpoints.sharded import Checkpoint

        def count(r, a, k):
            self.read += r.numel() * r.element_size()
            self.reads += 1

        def seen(r, a, k):
            t = next((x for x in [*a, *k.values(), *(y for x in a if isinstance(x, (list, tuple)) for y in x)]
                      if isinstance(x, torch.Tensor)), None)
            d = "none" if t is None else t.device.type
            self.solver_devices[d] = self.solver_devices.get(d, 0) + 1
        self._wrap(Checkpoint, "read", count)
        for fn in ("solve", "nested_heads", "inner_blocks"):
            self._wrap(S, fn, seen)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
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

    def now(self) -> dict:
        cuda = self.device.type == "cuda"
        return {"elapsed_s": time.perf_counter() - self.t0, "read_gb": self.read / GB,
                "rss_gb": (_status("VmRSS") or 0) / GB,
                "gpu_now_gb": torch.cuda.memory_allocated(self.device) / GB if cuda else None,
                "gpu_peak_gb": torch.cuda.max_memory_allocated(self.device) / GB if cuda else None}

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        for owner, attr, f in reversed(self._undo):
            setattr(owner, attr, f)
        hwm = _status("VmHWM") if self.hwm_reset else None
        self.rss_peak = max(self.rss_peak, hwm or 0)
        return False


def meminfo(fields=("MemAvailable", "Cached", "Dirty", "Writeback")) -> dict:
    """These ``/proc/meminfo`` fields in GB (dirty pages of a pair just written are still being
    written back while a run reads it); empty where it cannot be read."""
    out = {}
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in fields:
                out[k.lower() + "_gb"] = int(v.split()[0]) * 1024 / GB
    except (OSError, ValueError, IndexError):
        pass
    return out

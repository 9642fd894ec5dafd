"""``benchmarks.speed.peak_rss``: the sampled peak resident set really tracks allocations."""
from __future__ import annotations

import gc
import math
import time

import torch

from benchmarks import speed

MB = 2 ** 20


def test_rss_now_is_the_process_resident_set():
    rss = speed.rss_now_mb()
    assert math.isfinite(rss) and 10 < rss < 64 * 1024
    with open("/proc/self/status") as f:
        vmrss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(rss - vmrss_kb / 1024) < 50


def test_peak_rss_sees_a_transient_allocation():
    """~200 MB allocated, touched and freed inside the block: the peak records it even though
    the resident set is back down when the block ends."""
    gc.collect()
    before = speed.rss_now_mb()
    with speed.peak_rss() as m:
        x = torch.ones(200 * MB // 4, dtype=torch.float32)  # 200 MB, every page written
        assert float(x[:: 4096 // 4].sum()) == x.numel() / 1024
        time.sleep(0.05)  # let the sampler see it too
        del x
        gc.collect()
    after = speed.rss_now_mb()
    assert m["peak_mb"] - before >= 150, (before, m["peak_mb"])
    assert m["peak_mb"] - before < 400, (before, m["peak_mb"])
    assert m["peak_mb"] >= after


def test_peak_rss_sampler_catches_what_the_exit_reading_misses():
    """The peak comes from the background samples, not only from the readings at entry/exit."""
    gc.collect()
    before = speed.rss_now_mb()
    with speed.peak_rss(interval=1e-3) as m:
        x = torch.ones(200 * MB // 4, dtype=torch.float32)
        time.sleep(0.1)
        del x
        gc.collect()
        time.sleep(0.05)
        low = speed.rss_now_mb()
    assert low - before < 100  # freed before the block ended (glibc returns large blocks)
    assert m["peak_mb"] - before >= 150


def test_peak_rss_of_an_idle_block_stays_flat():
    gc.collect()
    before = speed.rss_now_mb()
    with speed.peak_rss() as m:
        y = torch.ones(1000)  # a few kB
        time.sleep(0.05)
    assert float(y.sum()) == 1000.0
    assert m["peak_mb"] - before < 30, (before, m["peak_mb"])
    assert m["peak_mb"] >= before - 30

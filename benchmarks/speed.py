"""Speed rows of the suite: ``symgraph.analyze`` and ``symgraph.align`` time and peak memory
on two cached zoo models of one architecture, measured in a fresh process.

A fresh process makes the peak-memory numbers about this work alone: the baseline is the
resident set after importing and loading the two models; during each step a background thread
samples the resident set (``/proc/self/statm``, every millisecond) and the step's peak is the
largest sample minus the baseline. (``ru_maxrss`` is useless here: importing and loading
already set a higher high-water mark than the tiny models' analysis reaches.)

``python -m benchmarks.speed ARCH [--size quick] [--seeds 0 1] [--batches 4] [--steps N]`` prints one JSON
object on its last line.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from contextlib import contextmanager


def rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@contextmanager
def peak_rss(interval: float = 1e-3):
    """Sample the resident set while the block runs; yields a dict whose ``"peak_mb"`` is set
    on exit (the largest sample, MB)."""
    box = {"peak_mb": rss_now_mb()}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            box["peak_mb"] = max(box["peak_mb"], rss_now_mb())
            stop.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield box
    finally:
        stop.set()
        th.join()
        box["peak_mb"] = max(box["peak_mb"], rss_now_mb())


def alignment_data(arch: str, n_batches: int) -> list:
    """Training-split batches as positional-input tuples (the form ``symgraph.align`` takes)."""
    from . import evaluate
    return [(b[evaluate.input_key(arch)],) for b in evaluate.eval_batches(arch, "train", n_batches)]


def measure(arch: str, size: str = "quick", seeds=(0, 1), batches: int = 4, steps: int | None = None) -> dict:
    """Time ``analyze`` (both models) and ``align`` (weights, activations); peak RSS in MB."""
    import torch

    import symgraph

    from . import train
    torch.set_num_threads(train.num_threads())
    a = train.train_model(arch, seeds[0], size, steps)
    b = train.train_model(arch, seeds[1], size, steps)
    data = alignment_data(arch, batches)
    base = rss_now_mb()
    with peak_rss() as m_an:
        t = time.perf_counter()
        ra = symgraph.analyze(a, data[0])
        t_an = time.perf_counter() - t
        rb = symgraph.analyze(b, data[0])
    with peak_rss() as m_w:
        t = time.perf_counter()
        symgraph.align(a, b, report_a=ra, report_b=rb)
        t_w = time.perf_counter() - t
    with peak_rss() as m_act:
        t = time.perf_counter()
        symgraph.align(a, b, data=data, report_a=ra, report_b=rb)
        t_act = time.perf_counter() - t
    peak_an, peak_w, peak_act = m_an["peak_mb"], m_w["peak_mb"], m_act["peak_mb"]
    weights_mb = sum(p.numel() * p.element_size() for p in a.parameters()) / 2 ** 20
    return {"arch": arch, "size": size, "seeds": list(seeds), "threads": torch.get_num_threads(),
            "groups": len(ra.groups), "parameters": sum(p.numel() for p in a.parameters()),
            "model_weights_mb": weights_mb, "baseline_rss_mb": base,
            "analyze_seconds": t_an, "align_weights_seconds": t_w,
            "align_activations_seconds": t_act, "alignment_batches": len(data),
            "peak_rss_analyze_mb": peak_an - base, "peak_rss_align_weights_mb": peak_w - base,
            "peak_rss_align_activations_mb": peak_act - base}


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--seeds", type=int, nargs=2, default=[0, 1])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="training steps of the cached models")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.arch, a.size, tuple(a.seeds), a.batches, a.steps)))


if __name__ == "__main__":
    _main()

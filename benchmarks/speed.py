"""Speed rows of the suite: ``symgraph.analyze`` and ``symgraph.align`` time and peak memory on two
cached zoo models of one architecture, in a fresh process: the baseline is the resident set after
importing and loading the models, a step's peak the largest resident set sampled every
millisecond during it (``/proc/self/statm``) minus the baseline (``ru_maxrss`` would be the
loading's). ``python -m benchmarks.speed ARCH [--size quick] [--seeds 0 1] [--batches 4]
[--steps N]`` prints one JSON object on its last line.
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
    """Time ``analyze`` (of one model; the peak: both) and ``align`` (weights, activations); peak RSS in MB."""
    import torch

    import symgraph

    from . import train
    torch.set_num_threads(train.num_threads())
    a, b = (train.train_model(arch, s, size, steps) for s in seeds)
    data = alignment_data(arch, batches)
    base = rss_now_mb()
    with peak_rss() as m_an:
        t = time.perf_counter()
        ra = symgraph.analyze(a, data[0])
        t_an = time.perf_counter() - t
        rb = symgraph.analyze(b, data[0])
    seconds, peaks = {"analyze": t_an}, {"analyze": m_an["peak_mb"]}
    for step, kw in (("align_weights", {}), ("align_activations", {"data": data})):
        with peak_rss() as m:
            t = time.perf_counter()
            symgraph.align(a, b, report_a=ra, report_b=rb, **kw)
            seconds[step] = time.perf_counter() - t
        peaks[step] = m["peak_mb"]
    return {"arch": arch, "size": size, "seeds": list(seeds), "threads": torch.get_num_threads(),
            "groups": len(ra.groups), "parameters": sum(p.numel() for p in a.parameters()),
            "model_weights_mb": sum(p.numel() * p.element_size() for p in a.parameters()) / 2 ** 20,
            "baseline_rss_mb": base, **{f"{k}_seconds": v for k, v in seconds.items()},
            "alignment_batches": len(data), **{f"peak_rss_{k}_mb": v - base for k, v in peaks.items()}}


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

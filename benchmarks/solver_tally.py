"""Measurement helpers of the device benchmarks (:mod:`benchmarks.bench_device_disk`): the
solver calls of a run counted by status and size (:class:`SolverTally`), and the switch that
makes a run solve every large square assignment by the device auction (:class:`forced_auction`;
the library's defaults are restored after the block)."""
from __future__ import annotations

import time

__all__ = ["FORCED_SPARSE_N", "SolverTally", "forced_auction"]

FORCED_SPARSE_N = 1 << 62  # --auction-layers: no square is solved sparse


class SolverTally:
    """While a run lasts: the calls of ``symgraph.solve._solvers``' ``hungarian`` and
    ``procrustes`` (what ``solve`` dispatches to), counted with their seconds by solver, status
    and size (``n`` from 1024 on; smaller ones together), readable while it runs."""

    current = None

    def __init__(self):
        self.calls: dict = {}

    def _wrap(self, name):
        from symgraph.solve import _solvers as SV
        f = getattr(SV, name)

        def shim(S, *a, **k):
            t = time.perf_counter()
            r = f(S, *a, **k)
            n = min(getattr(S, "shape", (0, 0))[-2:] or (0,))
            key = f"{name}: {r.status}" + (f" [n={n}]" if n >= 1024 else " [n<1024]")
            c = self.calls.setdefault(key, [0, 0.0])
            c[0] += 1
            c[1] += time.perf_counter() - t
            return r
        setattr(SV, name, shim)
        self._undo.append((SV, name, f))

    def __enter__(self):
        self._undo: list = []
        for name in ("hungarian", "procrustes"):
            self._wrap(name)
        SolverTally.current = self
        return self

    def __exit__(self, *exc):
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)
        SolverTally.current = None
        return False

    def summary(self) -> dict:
        return {k: {"calls": c, "seconds": round(s, 3)} for k, (c, s) in sorted(self.calls.items())}


class forced_auction:
    """The measurement switch of ``--auction-layers``: ``SPARSE_N`` raised for the block."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from symgraph.solve import _solvers as SV
        self.old = SV.SPARSE_N
        if self.on:
            SV.SPARSE_N = FORCED_SPARSE_N
        return self

    def __exit__(self, *exc):
        from symgraph.solve import _solvers as SV
        SV.SPARSE_N = self.old
        return False

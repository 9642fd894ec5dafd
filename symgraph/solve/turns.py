"""Host assignment solves of independent units at once, the rest one at a time in order.

The coordinate descent (:mod:`symgraph.alignment.sweeps`) solves the units of a *wave* (units
none of which reads a class another one solves: :class:`~symgraph.alignment.shared.Waves`)
through :func:`in_turn`: each unit on its own thread, the threads passing one *baton* so that
exactly one runs at a time, the first time in the wave's order. A thread gives the baton up
only while it waits for a host solve (:func:`outside`), so its similarity (every read and
write of the shared caches) runs before the next unit's starts, as in one thread; a solve's
result does not depend on when it ran. The alignment is therefore the sequential one, bit for
bit, with the host solves of up to :data:`THREADS` units overlapping.

SciPy's ``linear_sum_assignment`` releases the GIL while it solves and runs on the thread
itself; ``min_weight_full_bipartite_matching`` (LAPJVsp, the sparse solve of large squares)
holds it throughout, so within a turn it runs in a worker process (:func:`lapjvsp`): only its
``O(n·k)`` candidate edges (about 9 MB at n = 11008, k = 64) go there and two index vectors
come back. The workers are plain interpreters that import SciPy alone (not this package, not
the caller's ``__main__``), started on first use and kept until exit.
"""
from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["THREADS", "in_turn", "outside", "lapjvsp", "waited"]

#: Units whose host solves may run at once (threads, and LAPJVsp worker processes); 1: one
#: after the other on the calling thread, as before.
#: The default: the machine's cores, at most 8 (each unit waiting holds its similarity: an
#: MLP's n×n, 0.5 GB in float32 at n = 11008).
THREADS = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))

_turn = threading.local()  # .baton: the lock this thread holds while it runs; .waited: seconds


def in_turn(tasks: list) -> list:
    """``[task() for task in tasks]``, each on its own thread (at most :data:`THREADS` at once),
    one running at a time except while a task is in :func:`outside`; a task first runs after
    the one before it first gave the baton up (or ended). Results in order; the first task's
    exception (in order) is raised after all have ended."""
    if THREADS <= 1 or len(tasks) <= 1 or getattr(_turn, "baton", None) is not None:
        return [t() for t in tasks]  # (within a turn: its threads may all be taken)
    baton = threading.Lock()
    state = _state()
    out: list = [None] * len(tasks)
    errors: list = [None] * len(tasks)

    def call(i, started):
        held = False
        try:
            _adopt(state)
            baton.acquire()
            held = True
            _turn.baton, _turn.waited = baton, 0.0
            started.set()
            out[i] = tasks[i]()
        except BaseException as e:  # raised on the caller's thread, in the tasks' order
            errors[i] = e
        finally:
            _turn.baton = None
            if held:
                baton.release()
            started.set()

    pool = _threads()
    done = []
    for i in range(len(tasks)):
        started = threading.Event()
        done.append(pool.submit(call, i, started))
        started.wait()  # holds the baton (or ended): the next one queues behind it
    for f in done:
        f.result()
    for e in errors:
        if e is not None:
            raise e
    return out


_pool: list = [None, 0]  # the threads (kept: each keeps its torch thread team), for THREADS
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    with _pool_lock:
        if _pool[1] != THREADS:
            if _pool[0] is not None:
                _pool[0].shutdown(wait=False)
            _pool[:] = [ThreadPoolExecutor(THREADS, thread_name_prefix="symgraph-solve"), THREADS]
        return _pool[0]


def outside(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the baton given up (other units run meanwhile) when this
    thread is in :func:`in_turn`; ``fn`` must touch nothing the units share."""
    baton = getattr(_turn, "baton", None)
    if baton is None:
        return fn(*args, **kwargs)
    baton.release()
    try:
        return fn(*args, **kwargs)
    finally:
        t = time.perf_counter()
        baton.acquire()
        _turn.waited += time.perf_counter() - t


def waited() -> float:
    """Seconds this thread has waited to take the baton back (to leave out of solve times)."""
    return getattr(_turn, "waited", 0.0)


def lapjvsp(csr):
    """SciPy's ``min_weight_full_bipartite_matching(csr)``: in a worker process with the
    baton given up when this thread is in :func:`in_turn`, else here. The same arrays go in,
    so the same ``(rows, cols)`` come out (or the same ``ValueError``)."""
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching
    if getattr(_turn, "baton", None) is None:
        return min_weight_full_bipartite_matching(csr)
    job = pickle.dumps(((csr.data, csr.indices, csr.indptr), csr.shape), protocol=5)
    got = outside(_POOL.solve, job)
    if got is None:  # no worker could be used: here, holding the GIL (still the same result)
        return min_weight_full_bipartite_matching(csr)
    kind, value = got
    if kind == "ValueError":
        raise ValueError(value)
    return value


_WORKER = r"""
import pickle, sys
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    try:
        arrays, shape = pickle.load(inp)
    except EOFError:
        break
    try:
        got = ("ok", min_weight_full_bipartite_matching(csr_matrix(arrays, shape=shape)))
    except ValueError as e:
        got = ("ValueError", str(e))
    pickle.dump(got, out, protocol=5)
    out.flush()
"""


class _Workers:
    """Idle LAPJVsp worker processes, started as needed (at most :data:`THREADS` busy)."""

    def __init__(self):
        self.idle: list = []
        self.lock = threading.Lock()

    def solve(self, job: bytes):
        """The unpickled answer of a worker to ``job``, or None when none could be used."""
        with self.lock:
            w = self.idle.pop() if self.idle else None
        try:
            w = w or self._start()
            w.stdin.write(job)
            w.stdin.flush()
            got = pickle.load(w.stdout)
        except (OSError, EOFError, pickle.UnpicklingError):
            if w is not None:
                w.kill()
            return None
        with self.lock:
            self.idle.append(w)
        return got

    @staticmethod
    def _start():
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        return subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)

    def close(self):
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.stdin.close()  # the worker's loop ends at EOF
            try:
                w.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()


_POOL = _Workers()
atexit.register(_POOL.close)


def _state():
    """The caller's thread-local torch settings that a task's thread takes on: intra-op
    threads (a reduction split another way sums in another order), grad mode, CUDA device and
    stream."""
    cuda = torch.cuda.is_initialized()
    return (torch.get_num_threads(), torch.is_grad_enabled(),
            torch.cuda.current_stream() if cuda else None)


def _adopt(state):
    threads, grad, stream = state
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    if stream is not None:
        torch.cuda.set_stream(stream)  # also its device

"""A sweep's independent units solved with their host assignments overlapping
(:func:`symgraph.solve.turns.in_turn`, one process) give the sequential alignment bit for bit:
the same elements, solver objectives and number of sweeps, on a tiny LLaMA pair whose residual
stream is a rotation and one where it is a permutation; the assignments through SciPy's
``linear_sum_assignment`` on the units' threads and, with the sparse solve's threshold lowered,
through LAPJVsp in the worker processes."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scipy.sparse import eye as sparse_eye, random as sparse_random
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

import dist_align_worker
import symgraph
from symgraph.core.elements import Map, Perm
from symgraph.solve import _solvers, turns


@pytest.fixture(scope="module")
def pair():
    A, B = dist_align_worker.setup()
    reports = {fold: (symgraph.analyze(A, fold_norms=fold), symgraph.analyze(B, fold_norms=fold))
               for fold in (True, False)}
    return A, B, reports


def _aligned(pair, fold: bool, threads: int, monkeypatch, seen: dict):
    A, B, reports = pair
    real = turns.in_turn

    def counting(tasks):
        seen["wave"] = max(seen.get("wave", 0), len(tasks))
        return real(tasks)
    monkeypatch.setattr(turns, "THREADS", threads)
    monkeypatch.setattr(turns, "in_turn", counting)
    ra, rb = reports[fold]
    al = symgraph.align(A, B, report_a=ra, report_b=rb, fold_norms=fold)
    els = {k: v.index if isinstance(v, Perm) else v.co if isinstance(v, Map) else v for k, v in al.elements.items()}
    objs = {k: float(r.objective) for k, r in al.results.items()}
    return els, objs, al.seconds["sweeps"], al.shared


@pytest.mark.parametrize("fold", [True, False], ids=["rotation", "permutation"])
@pytest.mark.parametrize("sparse", [False, True], ids=["lsa", "lapjvsp"])
def test_concurrent_sweeps_are_the_sequential_alignment(pair, fold, sparse, monkeypatch):
    if sparse:  # every square assignment through LAPJVsp (in the workers when in a turn)
        monkeypatch.setattr(_solvers, "SPARSE_N", 2)
        monkeypatch.setattr(_solvers, "ROW_MAXIMA", False)
    calls = []
    real = turns._POOL.solve
    monkeypatch.setattr(turns._POOL, "solve", lambda job: calls.append(1) or real(job))
    seen: dict = {}
    els1, objs1, n1, shared1 = _aligned(pair, fold, 1, monkeypatch, seen)
    assert seen == {} and not calls  # one thread: no waves, no workers
    els4, objs4, n4, shared4 = _aligned(pair, fold, 4, monkeypatch, seen)
    assert seen["wave"] > 1  # units were solved together
    assert bool(calls) == sparse  # LAPJVsp went to the workers within a turn
    assert n1 == n4 > 1 and shared1 == shared4 == {}
    assert els1.keys() == els4.keys() and objs1 == objs4
    assert not [k for k in els1 if not torch.equal(els1[k], els4[k])]


def test_in_turn_runs_one_at_a_time_in_order_and_overlaps_outside():
    """Tasks start in order, never two at once outside :func:`outside`; a task waiting there
    lets the next run; results come back in order and the first error (in order) is raised."""
    log, inside, overlap = [], [0], []
    gate = threading.Event()

    def task(i):
        def run():
            inside[0] += 1
            assert inside[0] == 1
            log.append(("start", i))
            inside[0] -= 1
            if i == 0:  # waits (baton given up) until task 1 has run
                turns.outside(gate.wait, 10)
                overlap.append(("start", 1) in log)
            else:
                gate.set()
            return i * i
        return run
    old = turns.THREADS
    turns.THREADS = 3
    try:
        assert turns.in_turn([task(i) for i in range(3)]) == [0, 1, 4]
        assert [x for x in log] == [("start", 0), ("start", 1), ("start", 2)] and overlap == [True]

        def boom(i):
            def run():
                raise RuntimeError(str(i))
            return run
        with pytest.raises(RuntimeError, match="1"):
            turns.in_turn([lambda: 0, boom(1), boom(2)])
    finally:
        turns.THREADS = old


def test_the_worker_solves_as_scipy_does():
    """LAPJVsp in a worker process returns SciPy's own answer (and its error when the
    candidates hold no full matching)."""
    import pickle
    rng = np.random.default_rng(0)
    M = (sparse_random(300, 300, density=0.05, random_state=rng, format="csr") + 0.5 * sparse_eye(300)).tocsr()
    got = turns._POOL.solve(pickle.dumps(((M.data, M.indices, M.indptr), M.shape)))
    want = min_weight_full_bipartite_matching(M)
    assert got[0] == "ok" and all(np.array_equal(a, b) for a, b in zip(got[1], want))
    E = M.tolil()
    E[:, 0] = 0  # no edge into column 0
    E = E.tocsr()
    E.eliminate_zeros()
    bad = turns._POOL.solve(pickle.dumps(((E.data, E.indices, E.indptr), E.shape)))
    assert bad[0] == "ValueError"

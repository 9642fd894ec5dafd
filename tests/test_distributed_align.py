"""Weight matching shared between processes (:mod:`symgraph.alignment.shared`): two ``torchrun``
processes (gloo, CPU) split a tiny LLaMA pair's solves (each rank solves some units, the
residual stream's similarity is split by slot) and both end with the elements, and the
solvers' objectives, of one process, bit for bit (tests/dist_align_worker.py)."""
from __future__ import annotations

import pytest
import torch

import dist_align_worker
from dist_helpers import two_ranks

# Two torchrun processes (about 15-25 s): slow. Once, in a full CI run (xdist, 2 workers, under
# load), rank 0 aborted ("terminate called without an active exception") and the fixture failed;
# not reproduced alone or beside test_distributed/test_engine. To be found before it runs by default.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two processes wrote: ``[rank 0's, rank 1's]``."""
    return two_ranks("dist_align_worker.py", tmp_path_factory.mktemp("dist_align"))


@pytest.fixture(scope="module")
def one_process():
    """The same alignments in this process (one thread, as the ranks run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dist_align_worker.compute(*dist_align_worker.setup())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(dist_align_worker.CASES))
def test_shared_alignment_is_one_process_bit_for_bit(ranks, one_process, case):
    want, shared, sweeps = one_process[case]
    assert shared == {} and sweeps > 1  # one process: nothing shared; several sweeps ran
    assert any(isinstance(k, str) for k in want)  # the objectives
    for r, got in enumerate(x[case] for x in ranks):
        els, info, n = got
        assert n == sweeps
        assert els.keys() == want.keys()
        bad = [k for k in want if not torch.equal(els[k], want[k])]
        assert not bad, (r, bad)
        assert info["ranks"] == 2 and info["rank"] == r
    # B is a transformed copy of another model: the alignment found something to do
    assert not all(torch.equal(v, torch.arange(len(v))) for k, v in want.items()
                   if not isinstance(k, str) and v.dim() == 1 and not v.is_floating_point())


@pytest.mark.parametrize("case", list(dist_align_worker.CASES))
def test_the_work_was_split(ranks, case):
    """Each rank solved a strict, non-empty subset of the classes, together all of them once;
    the residual stream (group 0) was solved by all ranks together, each computing a strict
    share of its similarity's slot contributions."""
    infos = [x[case][1] for x in ranks]
    assert infos[0]["owners"] == infos[1]["owners"] and set(infos[0]["owners"].values()) == {0, 1}
    here = [set(i["solved_here"]) for i in infos]
    every = {k for k in ranks[0][case][0] if not isinstance(k, str)}  # group ids, not objectives
    assert here[0] and here[1] and not here[0] & here[1] and here[0] | here[1] == every
    assert 0 in infos[0]["collective"] and infos[0]["slots"] == infos[1]["slots"] > 0
    assert 0 < infos[0]["slots_here"] < infos[0]["slots"] and 0 < infos[1]["slots_here"] < infos[1]["slots"]
    assert infos[0]["slots_here"] + infos[1]["slots_here"] == infos[0]["slots"]

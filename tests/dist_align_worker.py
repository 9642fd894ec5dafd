"""One process of tests/test_distributed_align.py, under ``torchrun`` (gloo): weight matching
of a tiny LLaMA pair with the work shared between the processes (:mod:`symgraph.alignment.shared`).
Rank r writes ``OUT/rank{r}.pt``: ``{case: (elements, how the work was split)}``.

:func:`compute` is also what the test runs in one process."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import symgraph  # noqa: E402
from symgraph.alignment.weights import WeightFeatures  # noqa: E402
from symgraph.core.elements import Map, Perm  # noqa: E402
from symgraph.testing import models  # noqa: E402

# residual stream as a rotation (norms folded: its MLP slots pool) and as a permutation (the
# MLPs' slots pool too) with a pool budget that keeps some pools, not all (both MLPs' and
# none of the residual stream's: the ranks' keeps of the MLPs' pools are counted on both)
CASES = {"rotation": ({}, None), "permutation": ({"fold_norms": False}, 20000)}


def setup():
    """``(A, B)``: two tiny random LLaMAs, B a permuted and rotated copy of another seed's."""
    A = models.randomize_vectors(models.build("llama", 0), 0)
    other = models.randomize_vectors(models.build("llama", 1), 1)
    return A, symgraph.transform(other, symgraph.analyze(other).random_transform(seed=3))


def compute(A, B) -> dict:
    """``{case: ({group id: element as a tensor, "objective.<id>": solver objective},
    alignment.shared, sweeps)}``."""
    out = {}
    for name, (kw, pool_bytes) in CASES.items():
        old = WeightFeatures.POOL_BYTES
        WeightFeatures.POOL_BYTES = pool_bytes or old
        try:
            al = symgraph.align(A, B, **kw)
        finally:
            WeightFeatures.POOL_BYTES = old
        els = {k: v.index if isinstance(v, Perm) else v.co if isinstance(v, Map) else v
               for k, v in al.elements.items()}
        # the solvers' objectives too: a similarity summed in another order moves them, not
        # always a permutation
        els |= {f"objective.{k}": torch.tensor(float(r.objective), dtype=torch.float64)
                for k, r in al.results.items()}
        out[name] = (els, dict(al.shared), al.seconds["sweeps"])
    return out


def main(path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        A, B = setup()
        torch.save(compute(A, B), os.path.join(path, f"rank{dist.get_rank()}.pt"))
        dist.barrier()  # neither rank tears down while the other still talks
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # saved, and the group destroyed: leave without the interpreter's teardown, where native
    # threads (gloo's, torch's) can abort a process that has finished its work (SIGABRT,
    # "terminate called without an active exception", seen once on CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""One process of tests/test_distributed.py, under ``torchrun`` (gloo): the helpers of
:mod:`symgraph.core.distributed` on rank-specific values, then every data statistic and what is
solved from it, on this rank's shard of the batches. Rank r writes ``OUT/rank{r}.pt``.

:func:`compute` is also what the test runs in one process on all the batches."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import symgraph  # noqa: E402
from symgraph.core import distributed  # noqa: E402
from symgraph.testing import models  # noqa: E402
from symgraph.alignment.activations import ActStats, activation_similarity  # noqa: E402
from symgraph.core.elements import Perm  # noqa: E402
from symgraph.merging.methods.fisher import Fisher  # noqa: E402
from statistics_reference import input_grams, squared_gradients  # noqa: E402

BATCHES, BATCH, SEQ = 5, 2, 8  # 5 batches: uneven shards of 3 and 2


def setup():
    """``(A, B, batches)``: two tiny random GPT-2s, B a permuted copy of another seed's model
    (so that alignment has something to find), and the data batches."""
    A = models.randomize_vectors(models.build("gpt2", 0), 0)
    other = models.randomize_vectors(models.build("gpt2", 1), 1)
    B = symgraph.transform(other, symgraph.analyze(other).random_transform(seed=3))
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, 64, (BATCH, SEQ), generator=g)} for _ in range(BATCHES)]
    return A, B, batches


def compute(A, B, data) -> dict:
    """Every statistic on ``data`` (this rank's shard when distributed) and the solves: flat
    ``{name: tensor or number}``."""
    out = {}
    ra, rb = symgraph.analyze(A, data[0]), symgraph.analyze(B, data[0])
    pairs = list(zip(ra.groups, rb.groups))
    for i, s in activation_similarity(ra, rb, data, pairs, models=(A, B)).items():
        out[f"act.{i}.n"] = s.n
        out.update({f"act.{i}.{f}": getattr(s, f) for f in ("sa", "sb", "saa", "sbb", "sab")
                    if getattr(s, f) is not None})
    out.update({f"fisher.{k}": v for k, v in squared_gradients(B, rb, data, Fisher.statistic.loss).items()})
    out.update({f"regmean.{k}": v for k, v in input_grams(B, rb, data).items()})
    al = symgraph.align(A, B, data=data, report_a=ra, report_b=rb)
    for k, v in al.elements.items():  # a permutation as its index vector
        out[f"align.{k}"] = v.index if isinstance(v, Perm) else v
    res = symgraph.merge([A, B], data=data, align="activations", method="regmean", repair=True)
    out.update({f"merged.{k}": v.detach() for k, v in res.model.state_dict().items()})
    out.update({f"repair.{x.weight}": torch.tensor([x.before, x.after]) for x in res.repair.layers})
    # REPAIR alone: a plain average does not depend on the data
    res = symgraph.merge([A, B], data=data, align=None, repair=True)
    out.update({f"repaired.{k}": v.detach() for k, v in res.model.state_dict().items()
                if k.startswith("transformer.h.") and ".mlp.c_fc." in k})
    return out


def helpers(r: int) -> dict:
    """The helpers on values that differ per rank (world size 2)."""
    from symgraph.errors import InputError
    out = {"active": distributed.is_active(), "rank": distributed.rank(),
           "world": distributed.world_size(), "shard": distributed.shard(list(range(5)))}
    t = torch.full((3,), float(r + 1), dtype=torch.float32)
    out["sum_same"] = distributed.all_reduce_sum(t) is t
    out["sum"] = t
    # key sets differ: "only0" on rank 0 (float32), "only1" on rank 1 (int64), "n" Python ints
    d = {"a": torch.arange(4, dtype=torch.float64).reshape(2, 2) * (r + 1), "n": 3 + r}
    d.update({"only0": torch.ones(2, 3, dtype=torch.float32)} if r == 0 else
             {"only1": torch.tensor([7, 8], dtype=torch.int64)})
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    red = distributed.all_reduce_dict(d)
    out["dict_keys"] = list(red)
    out["dict"] = red
    out["dict_untouched"] = all(torch.equal(d[k], v) if isinstance(v, torch.Tensor) else d[k] == v
                                for k, v in before.items())
    # many small buckets: the same sums
    old, distributed._BUCKET = distributed._BUCKET, 3
    try:
        out["dict_small_buckets"] = distributed.all_reduce_dict(d)
    finally:
        distributed._BUCKET = old
    # a class with samples on rank 0 only: rank 1's sums (None) count as zeros
    s = ActStats()
    if r == 0:
        g = torch.Generator().manual_seed(0)
        s.add(torch.randn(6, 4, dtype=torch.float64, generator=g),
              torch.randn(6, 4, dtype=torch.float64, generator=g), 0)
    out["act_one_rank"] = {f: getattr(s.all_reduce(), f) for f in ("n", "sa", "sb", "saa", "sbb", "sab")}
    # one key, two shapes: refused on every rank (all of them see the same metadata)
    try:
        distributed.all_reduce_dict({"x": torch.zeros(2 + r)})
        out["mismatch"] = None
    except InputError as e:
        out["mismatch"] = str(e)
    return out


def main(path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        r = dist.get_rank()
        A, B, batches = setup()
        result = {"helpers": helpers(r), "stats": compute(A, B, distributed.shard(batches))}
        torch.save(result, os.path.join(path, f"rank{r}.pt"))
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

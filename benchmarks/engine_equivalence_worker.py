"""One case of :mod:`benchmarks.bench_engine_equivalence`, run as a script in a fresh process
with ``PYTHONPATH`` naming the source tree under test (so that ``symgraph`` is that tree's):
``python engine_equivalence_worker.py CASE OUT.safetensors``. Builds the case's tiny models
and data from seeds, runs ``symgraph.merge``, writes the merged state (every floating-point
tensor, in float32) and prints one JSON line: the seconds and where ``symgraph`` came from.
Uses only the public API both trees share."""
from __future__ import annotations

import json
import sys
import time

import torch

import symgraph
from symgraph.testing import models

N_BATCHES, ROWS, SEQ = 3, 4, 8
#: The merge settings users call; ``data``: the case's batches.
SETTINGS = {"average": dict(align="weights"), "unaligned": dict(align=None),
            "activations": dict(align="activations", data=True), "fisher": dict(method="fisher", data=True),
            "regmean": dict(method="regmean", data=True), "repair": dict(repair=True, data=True),
            "universe": dict(anchor="universe"), "circuits": dict(attention="circuits"), "untie": dict(untie=True),
            "universe_regmean": dict(anchor="universe", method="regmean", data=True),
            "full_groups": dict(full_groups=True), "weights_1_3": dict(weights=[1, 3])}


def _batches(make) -> list:
    g = torch.Generator().manual_seed(0)
    return [make(g) for _ in range(N_BATCHES)]


def case(name: str):
    """``(models, inputs, merge keywords)`` of case ``name``: ``arch/setting``."""
    arch, _, setting = name.partition("/")
    n = 3 if setting.startswith("universe") else 2
    if arch == "mlp":
        ms = [models.mlp(s, (6, 16, 12, 3)) for s in range(n)]
        data = _batches(lambda g: (torch.randn(32, 6, generator=g),))
    else:
        ms = [models.randomize_vectors(models.build(arch, s), s) for s in range(n)]
        if arch == "vit":
            data = _batches(lambda g: {"pixel_values": torch.randn(ROWS, 3, 8, 8, generator=g)})
        else:
            vocab = ms[0].config.vocab_size
            data = _batches(lambda g: {"input_ids": torch.randint(0, vocab, (ROWS, SEQ), generator=g)})
    kw = dict(SETTINGS[setting])
    if kw.pop("data", False):
        kw["data"] = data
    return ms, data[0] if arch == "mlp" else None, kw


def main(argv) -> int:
    name, out = argv[1], argv[2]
    ms, inputs, kw = case(name)
    t0 = time.perf_counter()
    res = symgraph.merge(ms, inputs, **kw)
    seconds = time.perf_counter() - t0
    from safetensors.torch import save_file
    # tied tensors: own copies
    save_file({k: v.detach().float().clone() for k, v in res.model.state_dict().items() if v.is_floating_point()}, out)
    print(json.dumps({"case": name, "seconds": seconds, "symgraph": symgraph.__file__}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

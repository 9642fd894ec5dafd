"""Benchmark: ``symgraph.align`` on a BERT-base-shaped pair vs a plain Zhang et al. 2024 matching.

Both models have random weights (12 layers, hidden 768, MLP 3072, 12 heads); B is a random
symmetry transform of A, so the alignment has a known answer. In the same run a plain
re-implementation of Zhang et al. 2024's matching (FFN Hungarian + per-head Procrustes on QK and
VO, no residual or head permutation) is timed: the ratio, the share of time in the
assignment/SVD solvers, and peak resident memory during ``align`` (sampled from /proc) relative
to the two models' weights. The alignment is also timed with the row-maxima certificate off
(every assignment through the LSAP solver), since on this exactly-recoverable pair it always
applies.

``python -m benchmarks.bench_align [--layers 12] [--out FILE]``
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from scipy.optimize import linear_sum_assignment

from .provenance import write_beside
from .speed import peak_rss, rss_now_mb


def _features(M, i: int, heads: int):
    """Layer ``i``'s FFN unit features and, per head, its QK and VO features."""
    w = lambda n: M.get_parameter(f"bert.encoder.layer.{i}.{n}").detach()  # noqa: E731
    q, k, v = (w(f"attention.self.{n}.weight") for n in ("query", "key", "value"))
    o = w("attention.output.dense.weight")
    d = q.shape[0] // heads
    ffn = torch.cat([w("intermediate.dense.weight"), w("intermediate.dense.bias")[:, None],
                     w("output.dense.weight").T], 1)
    sl = [slice(h * d, (h + 1) * d) for h in range(heads)]
    return ffn, [(torch.cat([q[s], k[s]], 1), torch.cat([v[s], o[:, s].T], 1)) for s in sl]


def zhang2025_matching(A, B, layers, heads):
    """FFN Hungarian + per-head Procrustes (QK and VO) from weights, in the weights' own dtype, as
    a plain implementation would run it: ``(seconds, seconds in the solvers)``."""
    solver_s = 0.0
    t0 = time.perf_counter()
    for i in range(layers):
        (fa, ha), (fb, hb) = _features(A, i, heads), _features(B, i, heads)
        S = fa @ fb.T
        t = time.perf_counter()
        linear_sum_assignment(S.numpy(), maximize=True)
        solver_s += time.perf_counter() - t
        for (qk_a, vo_a), (qk_b, vo_b) in zip(ha, hb):
            for x, y in ((qk_a, qk_b), (vo_a, vo_b)):
                t = time.perf_counter()
                U, _, Vh = torch.linalg.svd(x @ y.T)
                _ = U @ Vh
                solver_s += time.perf_counter() - t
    return time.perf_counter() - t0, solver_s


def run(layers: int = 12, threads: int | None = None) -> dict:
    import transformers

    import symgraph
    from symgraph.solve import _solvers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_size=768, intermediate_size=3072,
                                  num_attention_heads=12, vocab_size=30522)
    torch.manual_seed(0)
    A = transformers.BertForMaskedLM(cfg).eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=1, orthogonal=True))
    weights_mb = 2 * sum(p.numel() * p.element_size() for p in A.parameters()) / 2 ** 20
    rss_before = rss_now_mb()
    with peak_rss() as mem:
        t = time.perf_counter()
        al = symgraph.align(A, B, report_a=rep)
        t_align = time.perf_counter() - t
    C = al.apply(B)
    err = max(float((p - q).norm() / p.norm()) for p, q in zip(A.parameters(), C.parameters()))
    del C
    hits = sum(r.status.startswith("optimal (row") for r in al.results.values())
    _solvers.ROW_MAXIMA = False  # the same alignment, every assignment through the LSAP solver
    try:
        t = time.perf_counter()
        al2 = symgraph.align(A, B, report_a=rep)
        t_plain = time.perf_counter() - t
    finally:
        _solvers.ROW_MAXIMA = True
    t_seed, s_seed = zhang2025_matching(A, B, layers, 12)
    res = {
        "config": f"BERT-base-shaped, {layers} layers, 768/3072/12 heads, random weights; B is a "
                  "random symmetry transform of A",
        "torch_threads": torch.get_num_threads(),
        "groups_aligned": len(al.results), "groups_in_report": len(rep.groups),
        "align_seconds": t_align, "align_solver_seconds": al.seconds.get("solver"),
        "align_solver_share": (al.seconds.get("solver") or 0) / t_align,
        "align_analyze_seconds_model_b": al.seconds.get("analyze"),
        "sweeps": al.seconds.get("sweeps"),
        "assignments_certified_by_row_maxima": hits,
        "align_seconds_without_row_maxima": t_plain,
        "align_solver_seconds_without_row_maxima": al2.seconds.get("solver"),
        "zhang2025_seconds": t_seed, "zhang2025_solver_seconds": s_seed,
        "zhang2025_solver_share": s_seed / t_seed,
        "ratio_align_over_zhang2025": t_align / t_seed,
        "ratio_align_over_zhang2025_without_row_maxima": t_plain / t_seed,
        "ratio_align_minus_analyze_over_zhang2025": (t_align - al.seconds.get("analyze", 0)) / t_seed,
        "two_models_weights_mb": weights_mb,
        "rss_before_align_mb": rss_before, "peak_rss_during_align_mb": mem["peak_mb"],
        "peak_rss_mb": mem["peak_mb"],
        "peak_over_weights": mem["peak_mb"] / weights_mb,
        "align_extra_over_weights": (mem["peak_mb"] - rss_before) / weights_mb,
        "recovery_max_rel_error": err,
    }
    for k, v in res.items():
        print(f"{k:>32}: {v:.4g}" if isinstance(v, float) else f"{k:>32}: {v}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_align", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/align_bert_base.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    a = ap.parse_args(argv)
    res = run(a.layers, a.threads)
    if a.out:
        write_beside(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

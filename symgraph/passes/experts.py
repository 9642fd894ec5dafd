"""The experts implementation a Hugging Face mixture-of-experts block runs under
(``config._experts_implementation``) while symgraph runs or traces it.

``grouped_mm`` (transformers' default) sorts tokens by expert, an order that depends on the
routing labels' values, so no rule can follow the experts through it, and its kernel has no
float64 (``Expected mat_a to be Float32, BFloat16 or Float16``): a float64 model's forward
fails under it. ``batched_mm`` is the same function: it gathers each token's expert weights and
uses batched matmuls (:mod:`.labels`), in every dtype. The trace, the certificate and the trial
runs that choose example inputs (:mod:`.optional_inputs`) all run under it, so the inputs a
model gets, and so its report, do not depend on its dtype.
"""
from __future__ import annotations

import contextlib

__all__ = ["batched_experts"]


@contextlib.contextmanager
def batched_experts(model):
    """Every config of ``model``'s modules that names an experts implementation other than
    ``batched_mm`` or ``eager`` set to ``batched_mm`` while inside; restored afterwards."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    experts = {k: c._experts_implementation for k, c in configs.items()
               if isinstance(getattr(c, "_experts_implementation", None), str)}
    try:
        for k in experts:
            if configs[k]._experts_implementation not in ("batched_mm", "eager"):
                configs[k]._experts_implementation = "batched_mm"
        yield model
    finally:
        for k, v in experts.items():
            configs[k]._experts_implementation = v

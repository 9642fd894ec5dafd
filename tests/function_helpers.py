"""What tests of function-preserving changes share: a model's logits in float64, their relative
difference, and the check that alignment by weights recovers a transformed copy exactly."""
from __future__ import annotations

import torch

import symgraph


def logits(model, x):
    """``model``'s logits on token ids ``x`` (or its first output), in float64."""
    with torch.no_grad():
        out = model(input_ids=x)
    return (out.logits if hasattr(out, "logits") else out[0]).double()


def rel(a, b) -> float:
    """``‖a − b‖ / ‖a‖``."""
    return float((a - b).norm() / a.norm())


def assert_recovered(model, moved, inputs, atol=1e-6):
    """Aligning ``moved`` to ``model`` on ``inputs`` gives back every tensor of ``model``."""
    back = symgraph.align(model, moved, inputs).apply(moved)
    for k, v in model.state_dict().items():
        assert torch.allclose(back.state_dict()[k], v, atol=atol, rtol=0), k

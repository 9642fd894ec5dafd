"""What the merge-engine tests share: a merged checkpoint's tensors and their largest relative
difference."""
from __future__ import annotations

import os

from safetensors.torch import load_file


def load(path) -> dict:
    """Every tensor of the safetensors files in ``path``."""
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def rel(a, b) -> float:
    """The largest relative max-difference over the tensors of ``a`` and ``b`` (same names)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in a)

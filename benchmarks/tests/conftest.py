"""The benchmark tooling's tests run like the package's (tests/conftest.py): offline, quiet,
one torch thread."""
from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

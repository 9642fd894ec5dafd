"""The benchmark tooling's tests run as the package's do (tests/conftest.py): offline, quiet, one
torch thread, and the ``fakegpu`` test device registered before any backward pass (not for the
gpu tests on a CUDA machine, ``SYMGRAPH_GPU_TESTS=1``: see tests/conftest.py)."""
from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
if os.environ.get("SYMGRAPH_GPU_TESTS") != "1":
    from symgraph.testing.device import install  # noqa: E402
    install()

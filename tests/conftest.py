"""Shared tiny-model fixtures: random-weight, two-layer models of the architectures symgraph
must understand (built by :mod:`symgraph.testing.models`), each analysed once per session.

Every 1-d parameter (norm weights, biases) is re-drawn at random: Hugging Face initialises
norm weights to ones and biases to zeros, which every permutation leaves unchanged and would
hide a wrong bias or norm slot from the certificates.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import symgraph  # noqa: E402
from symgraph.testing import models  # noqa: E402
from symgraph.testing.models import randomize_vectors  # noqa: E402, F401 - re-exported for tests

transformers.logging.set_verbosity_error()
# tiny models: a second thread only adds synchronisation (and, beside another busy process,
# oversubscription that made one file 10x slower); tests that want more threads set them
torch.set_num_threads(1)
# the test device (tests/test_device.py) is registered before any backward pass: autograd's
# engine sizes its per-device queues when it first runs. Not for the gpu tests on a CUDA
# machine (SYMGRAPH_GPU_TESTS=1): once a PrivateUse1 backend is registered it is torch's
# accelerator, and every CUDA backward fails ("opt_ready_stream && opt_parent_stream
# INTERNAL ASSERT FAILED", pytorch/pytorch#161129; seen on an H200 with torch 2.11)
if os.environ.get("SYMGRAPH_GPU_TESTS") != "1":
    from symgraph.testing.device import install as _install_test_device  # noqa: E402
    _install_test_device()

LAYERS = 2


@dataclass
class Tiny:
    """A tiny model, its config, the inputs it was analysed with (None: built from the
    config) and its report."""
    name: str
    model: torch.nn.Module
    report: object
    config: object = None
    inputs: object = None
    info: dict = field(default_factory=dict)


# --- builders (also used directly by tests that need a fresh model) -------------------------
# The fixtures' configs keep Hugging Face's default use_cache (and GPT-2 no pad token): they
# predate symgraph.testing.models' conventions, and tests may compare against them.
_LEGACY = {"gpt2": {"pad_token_id": None}}


def build_hf(name, seed=0, device=None):
    """``(model, config)``: the tiny ``name`` model of :mod:`symgraph.testing.models` (two layers,
    seed ``seed``, eval mode), its 1-d parameters re-drawn unless built on ``device``."""
    model = models.build(name, seed, device=device, use_cache=None, **_LEGACY.get(name, {}))
    if device is None:
        randomize_vectors(model, seed)
    return model, model.config


def build_transformer_encoder(seed=0, d=16, heads=4, ff=40):
    model = randomize_vectors(models.transformer_encoder(seed, d, heads, ff, layers=LAYERS), seed)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed))
    return model, (x,), {"d": d, "heads": heads, "ff": ff}


def build_mlp(seed=0, widths=(6, 16, 12, 3)):
    model = randomize_vectors(models.mlp(seed, widths), seed)
    x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(seed))
    return model, (x,), {"widths": widths}


def _hf_fixture(name):
    model, cfg = build_hf(name)
    return Tiny(name, model, symgraph.analyze(model), cfg)


@pytest.fixture(scope="session")
def bert():
    return _hf_fixture("bert")


@pytest.fixture(scope="session")
def gpt2():
    return _hf_fixture("gpt2")


@pytest.fixture(scope="session")
def llama():
    return _hf_fixture("llama")


@pytest.fixture(scope="session")
def vit():
    return _hf_fixture("vit")


@pytest.fixture(scope="session")
def phi():
    return _hf_fixture("phi")


@pytest.fixture(scope="session")
def gptj():
    return _hf_fixture("gptj")


@pytest.fixture(scope="session")
def neox():
    return _hf_fixture("neox")


@pytest.fixture(scope="session")
def encoder():
    model, inputs, info = build_transformer_encoder()
    return Tiny("encoder", model, symgraph.analyze(model, inputs=inputs), None, inputs, info)


@pytest.fixture(scope="session")
def mlp():
    model, inputs, info = build_mlp()
    return Tiny("mlp", model, symgraph.analyze(model, inputs=inputs), None, inputs, info)


@pytest.fixture
def tiny(request):
    """Indirect access to the session fixtures by name (for parametrised tests)."""
    return request.getfixturevalue(request.param)


# --- the command line, as a subprocess ----------------------------------------------------
CLI_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def cli(*args, cwd=None, timeout=180):
    """Run ``python -m symgraph.cli *args``; returns the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)],
                          capture_output=True, text=True, env=CLI_ENV, cwd=cwd, timeout=timeout)


def successor_sampler(seed, vocab=64):
    """Batches of a noisy deterministic successor language (``x -> 3x + 1 mod vocab``, 20%
    noise), 16 rows of 16 tokens with ``labels = input_ids``: what tiny LMs learn in seconds."""
    g = torch.Generator().manual_seed(seed)

    def sample():
        seq = [torch.randint(0, vocab, (16, 1), generator=g)]
        for _ in range(15):
            nxt = (3 * seq[-1] + 1) % vocab
            noise = torch.randint(0, vocab, nxt.shape, generator=g)
            seq.append(torch.where(torch.rand(nxt.shape, generator=g) < 0.2, noise, nxt))
        ids = torch.cat(seq, 1)
        return {"input_ids": ids, "labels": ids}
    return sample


def checkpoint_tensors(d) -> dict:
    """Every tensor of the ``model*.safetensors`` files of directory ``d``."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.startswith("model") and f.endswith(".safetensors"):
            out |= load_file(os.path.join(d, f))
    return out

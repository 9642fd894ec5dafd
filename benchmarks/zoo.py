"""Model zoo of the benchmark suite: tiny Hugging Face models sized for CPU.

Every model is one row of :data:`SPECS`, the single table of sizes and training budgets, with a
``quick``, a ``medium`` and a ``full`` :class:`SizeSetting` (``quick``: what CI and the default
run use). Configs and models are built by :mod:`symgraph.testing.models` (the one builder of
tiny models); this module holds only the table.

Conventions shared by all models: dropout 0 everywhere (training and evaluation mode give the
same outputs); attention :data:`ATTN_IMPLEMENTATION` unless overridden; decoders built with
``use_cache=False`` (callers still pass it to ``forward``); the vocabulary of
:mod:`benchmarks.data` (``[PAD]`` = 0); a model built by :func:`build_model` for a seed is
bit-identical across calls (``torch.manual_seed(seed)`` right before construction).

:data:`ARCHS` are the default four. ``mixtral`` (:data:`MOE_ARCHS`: its expert order is a
permutation class of the router rows and stacked expert weights) and ``gpt2_untied``
(:data:`VARIANT_ARCHS`) are chosen with ``python -m benchmarks --archs``. ``gpt2`` and
``gpt2_wide`` (:data:`WIDE_NARROW_PAIR`) differ only in MLP width: the heterogeneous-fusion pair.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from symgraph.testing import models

from . import data

__all__ = ["ATTN_IMPLEMENTATION", "SIZES", "SizeSetting", "ModelSpec", "SPECS", "ARCHS", "MOE_ARCHS", "VARIANT_ARCHS",
           "WIDE_NARROW_PAIR", "get_spec", "get_setting", "make_config", "model_class", "build_model"]

#: Attention implementation used by every model unless overridden.
ATTN_IMPLEMENTATION = "sdpa"
#: Size settings every spec provides.
SIZES = ("quick", "medium", "full")


@dataclass(frozen=True)
class SizeSetting:
    """Architecture size and training budget for one (spec, size) pair."""

    hidden: int  # the residual stream's width
    layers: int
    heads: int  # attention (query) heads
    mlp_mult: int  # the MLP's hidden width as a multiple of ``hidden``
    steps: int  # AdamW steps
    batch_size: int  # sequences (or images) per step
    lr: float  # peak learning rate (linear warm-up, cosine decay)
    kv_heads: int | None = None  # key/value heads of grouped-query attention; None: one per query head

    @property
    def mlp_width(self) -> int:
        """MLP hidden width, ``mlp_mult * hidden``."""
        return self.mlp_mult * self.hidden


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the model zoo. ``medium`` is the size of the published transformer alignment
    results (6 layers, width 256, 4 heads, MLP 1024; Theus et al. 2025 use 6-8 layers of width
    256-512), trained until the held-out loss stops improving."""

    name: str  # its key in SPECS (and in cache keys)
    family: str  # the Hugging Face family: bert, gpt2, llama, vit, mixtral
    task: str  # mlm (masked LM), clm (next-token LM), cls (classification)
    dataset: str  # of benchmarks.data: prose, code, digits
    block_size: int  # tokens per sequence (LMs; one for every size, so evaluation does not depend on it)
    quick: SizeSetting
    medium: SizeSetting
    full: SizeSetting
    extra: Mapping[str, Any] = field(default_factory=dict)  # family-specific config keywords

    def setting(self, size: str) -> SizeSetting:
        """Return the :class:`SizeSetting` for ``size`` (one of :data:`SIZES`)."""
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        return getattr(self, size)


# --- the spec table ---------------------------------------------------------
# Quick settings are sized so that all 4 architectures x 3 seeds + gpt2_wide
# train in a few minutes on 2 CPU cores; full settings are twice as wide and deep.

_LM_QUICK = SizeSetting(hidden=64, layers=2, heads=4, mlp_mult=4, steps=500, batch_size=32, lr=3e-3)
_LM_MEDIUM = SizeSetting(hidden=256, layers=6, heads=4, mlp_mult=4, steps=1000, batch_size=32, lr=1e-3)
_LM_FULL = SizeSetting(hidden=128, layers=4, heads=4, mlp_mult=4, steps=2000, batch_size=32, lr=1e-3)

SPECS: dict[str, ModelSpec] = {
    "bert": ModelSpec(
        name="bert", family="bert", task="mlm", dataset="prose", block_size=64,
        quick=dataclasses.replace(_LM_QUICK, steps=700),
        medium=_LM_MEDIUM,
        full=dataclasses.replace(_LM_FULL, steps=3000),
    ),
    "gpt2": ModelSpec(
        name="gpt2", family="gpt2", task="clm", dataset="prose", block_size=64,
        quick=_LM_QUICK, medium=_LM_MEDIUM, full=_LM_FULL,
    ),
    "gpt2_wide": ModelSpec(
        name="gpt2_wide", family="gpt2", task="clm", dataset="prose", block_size=64,
        quick=dataclasses.replace(_LM_QUICK, mlp_mult=8),
        medium=dataclasses.replace(_LM_MEDIUM, mlp_mult=8),
        full=dataclasses.replace(_LM_FULL, mlp_mult=8),
    ),
    # as gpt2 with its own output head: the residual stream then admits the orthogonal maps
    # fixing the all-ones vector (the final LayerNorm's gain folds into the head)
    "gpt2_untied": ModelSpec(
        name="gpt2_untied", family="gpt2", task="clm", dataset="prose", block_size=64,
        quick=_LM_QUICK, medium=_LM_MEDIUM, full=_LM_FULL,
        extra={"tie_word_embeddings": False},
    ),
    "llama": ModelSpec(
        name="llama", family="llama", task="clm", dataset="code", block_size=64,
        quick=dataclasses.replace(_LM_QUICK, kv_heads=2),
        medium=dataclasses.replace(_LM_MEDIUM, kv_heads=2),
        full=dataclasses.replace(_LM_FULL, kv_heads=2),
        extra={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    ),
    "vit": ModelSpec(
        name="vit", family="vit", task="cls", dataset="digits", block_size=0,
        quick=SizeSetting(hidden=64, layers=2, heads=4, mlp_mult=4, steps=300, batch_size=64, lr=2e-3),
        medium=SizeSetting(hidden=256, layers=6, heads=4, mlp_mult=4, steps=1000, batch_size=64, lr=1e-3),
        full=SizeSetting(hidden=128, layers=4, heads=4, mlp_mult=4, steps=2000, batch_size=64, lr=1e-3),
        extra={"patch_size": 2},
    ),
    # 4 experts of 2*hidden units each, top-2: as many active MLP units per token as the
    # dense models' 4*hidden
    "mixtral": ModelSpec(
        name="mixtral", family="mixtral", task="clm", dataset="prose", block_size=64,
        quick=dataclasses.replace(_LM_QUICK, mlp_mult=2, kv_heads=2),
        medium=dataclasses.replace(_LM_MEDIUM, mlp_mult=2, kv_heads=2),
        full=dataclasses.replace(_LM_FULL, mlp_mult=2, kv_heads=2),
        extra={"num_local_experts": 4, "num_experts_per_tok": 2,
               "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    ),
}

#: The four base architectures, one per model family.
ARCHS = ("bert", "gpt2", "llama", "vit")
#: Mixture-of-experts decoders: selectable (``--archs``), not in the default :data:`ARCHS`.
MOE_ARCHS = ("mixtral",)
#: Variants of a base architecture, selectable (``--archs``), not in the default :data:`ARCHS`.
VARIANT_ARCHS = ("gpt2_untied",)
#: (narrow, wide) spec names of the heterogeneous-fusion pair.
WIDE_NARROW_PAIR = ("gpt2", "gpt2_wide")


def get_spec(arch: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``arch`` (a key of :data:`SPECS`)."""
    try:
        return SPECS[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(SPECS)}") from None


def get_setting(arch: str, size: str = "quick") -> SizeSetting:
    """Return the :class:`SizeSetting` of ``arch`` at ``size``."""
    return get_spec(arch).setting(size)


def _overrides(spec: ModelSpec, size: str) -> dict[str, Any]:
    """The :func:`symgraph.testing.models.config` keywords of ``spec`` at ``size``."""
    s = spec.setting(size)
    sizes = dict(hidden=s.hidden, layers=s.layers, heads=s.heads, mlp=s.mlp_width)
    tokens = dict(bos_token_id=data.PAD_ID, eos_token_id=data.PAD_ID, pad_token_id=data.PAD_ID)
    if spec.family == "bert":
        family = dict(vocab=data.VOCAB_SIZE, positions=spec.block_size, type_vocab_size=1,
                      pad_token_id=data.PAD_ID)
    elif spec.family == "gpt2":
        family = dict(vocab=data.VOCAB_SIZE, positions=spec.block_size, summary_first_dropout=0.0, **tokens)
    elif spec.family in ("llama", "mixtral"):
        family = dict(vocab=data.VOCAB_SIZE, positions=spec.block_size, kv_heads=s.kv_heads or s.heads,
                      tie_word_embeddings=False, **tokens)
    elif spec.family == "vit":
        family = dict(image_size=data.DIGIT_IMAGE_SIZE, channels=1, num_labels=data.NUM_DIGIT_CLASSES)
    else:
        raise AssertionError(f"unhandled family {spec.family!r}")
    # architectures=None: the configs stay as the checkpoint fingerprints recorded them
    # (save_pretrained writes the class name into the saved config anyway)
    return {**sizes, **family, "architectures": None, **spec.extra}


def make_config(arch: str, size: str = "quick"):
    """The Hugging Face config of zoo model ``arch`` at ``size`` (one of :data:`SIZES`; through
    :func:`symgraph.testing.models.config`): dropout 0, decoders ``use_cache=False``."""
    spec = get_spec(arch)
    return models.config(spec.family, **_overrides(spec, size))


def model_class(arch: str) -> type:
    """Return the Hugging Face model class of ``arch`` (for ``from_pretrained``)."""
    return models.model_class(get_spec(arch).family)


def build_model(arch: str, seed: int, size: str = "quick", attn_implementation: str | None = None) -> torch.nn.Module:
    """Zoo model ``arch`` at ``size``, initialised from ``seed`` (bit-identical for a seed), in
    ``eval()`` mode, on the CPU, float32 (through :func:`symgraph.testing.models.build`);
    ``attn_implementation`` default :data:`ATTN_IMPLEMENTATION`."""
    spec = get_spec(arch)
    return models.build(spec.family, seed, attn_implementation=attn_implementation or ATTN_IMPLEMENTATION,
                        **_overrides(spec, size))

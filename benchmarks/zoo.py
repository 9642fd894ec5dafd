"""Model zoo of the benchmark suite: tiny Hugging Face models sized for CPU.

Every model is one row of :data:`SPECS`, with a ``quick`` (what CI and the default run use), a
``medium`` and a ``full`` :class:`SizeSetting`. Configs and models are built by
:mod:`symgraph.testing.models`. Conventions: dropout 0 everywhere; attention
:data:`ATTN_IMPLEMENTATION`; decoders built with ``use_cache=False``; the vocabulary of
:mod:`benchmarks.data` (``[PAD]`` = 0); a model built for a seed is bit-identical across calls.

:data:`ARCHS` are the default four; ``mixtral`` (:data:`MOE_ARCHS`) and ``gpt2_untied``
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

ATTN_IMPLEMENTATION = "sdpa"
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
    lr: float  # peak learning rate
    kv_heads: int | None = None  # key/value heads of grouped-query attention; None: one per query head

    @property
    def mlp_width(self) -> int:
        return self.mlp_mult * self.hidden


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the model zoo. ``medium`` is the size of the published transformer alignment
    results (6 layers, width 256, 4 heads, MLP 1024; Theus et al. 2025 use 6-8 layers of width
    256-512)."""
    family: str  # the Hugging Face family: bert, gpt2, llama, vit, mixtral
    task: str  # mlm (masked LM), clm (next-token LM), cls (classification)
    dataset: str  # of benchmarks.data: prose, code, digits
    block_size: int  # tokens per sequence (LMs; one for every size)
    quick: SizeSetting
    medium: SizeSetting
    full: SizeSetting
    extra: Mapping[str, Any] = field(default_factory=dict)  # family-specific config keywords

    def setting(self, size: str) -> SizeSetting:
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        return getattr(self, size)


# quick: all 4 architectures x 3 seeds + gpt2_wide train in a few minutes on 2 CPU cores
_LM_QUICK = SizeSetting(hidden=64, layers=2, heads=4, mlp_mult=4, steps=500, batch_size=32, lr=3e-3)
_LM_MEDIUM = SizeSetting(hidden=256, layers=6, heads=4, mlp_mult=4, steps=1000, batch_size=32, lr=1e-3)
_LM_FULL = SizeSetting(hidden=128, layers=4, heads=4, mlp_mult=4, steps=2000, batch_size=32, lr=1e-3)
_DECODER = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"}


def _lm(family: str, dataset: str = "prose", extra=None, **change) -> ModelSpec:
    """A language-model spec: the LM sizes with ``change`` (``steps`` only for ``quick``)."""
    quick = dataclasses.replace(_LM_QUICK, **change)
    change.pop("steps", None)
    return ModelSpec(family=family, task="mlm" if family == "bert" else "clm", dataset=dataset,
                     block_size=64, quick=quick, medium=dataclasses.replace(_LM_MEDIUM, **change),
                     full=dataclasses.replace(_LM_FULL, **change), extra=extra or {})


SPECS: dict[str, ModelSpec] = {
    "bert": dataclasses.replace(_lm("bert", steps=700), full=dataclasses.replace(_LM_FULL, steps=3000)),
    "gpt2": _lm("gpt2"),
    "gpt2_wide": _lm("gpt2", mlp_mult=8),
    # gpt2 with its own output head: the residual stream then admits the orthogonal maps fixing
    # the all-ones vector (the final LayerNorm's gain folds into the head)
    "gpt2_untied": _lm("gpt2", extra={"tie_word_embeddings": False}),
    "llama": _lm("llama", "code", extra=_DECODER, kv_heads=2),
    "vit": ModelSpec(
        family="vit", task="cls", dataset="digits", block_size=0,
        quick=SizeSetting(hidden=64, layers=2, heads=4, mlp_mult=4, steps=300, batch_size=64, lr=2e-3),
        medium=SizeSetting(hidden=256, layers=6, heads=4, mlp_mult=4, steps=1000, batch_size=64, lr=1e-3),
        full=SizeSetting(hidden=128, layers=4, heads=4, mlp_mult=4, steps=2000, batch_size=64, lr=1e-3),
        extra={"patch_size": 2},
    ),
    # 4 experts of 2*hidden units, top-2: as many active MLP units per token as the dense 4*hidden
    "mixtral": _lm("mixtral", extra={"num_local_experts": 4, "num_experts_per_tok": 2, **_DECODER},
                   mlp_mult=2, kv_heads=2),
}

ARCHS = ("bert", "gpt2", "llama", "vit")
MOE_ARCHS = ("mixtral",)
VARIANT_ARCHS = ("gpt2_untied",)
#: (narrow, wide) spec names of the heterogeneous-fusion pair.
WIDE_NARROW_PAIR = ("gpt2", "gpt2_wide")


def get_spec(arch: str) -> ModelSpec:
    try:
        return SPECS[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(SPECS)}") from None


def get_setting(arch: str, size: str = "quick") -> SizeSetting:
    return get_spec(arch).setting(size)


def _overrides(spec: ModelSpec, size: str) -> dict[str, Any]:
    """The :func:`symgraph.testing.models.config` keywords of ``spec`` at ``size``."""
    s = spec.setting(size)
    sizes = dict(hidden=s.hidden, layers=s.layers, heads=s.heads, mlp=s.mlp_width)
    tokens = dict(bos_token_id=data.PAD_ID, eos_token_id=data.PAD_ID, pad_token_id=data.PAD_ID)
    lm = dict(vocab=data.VOCAB_SIZE, positions=spec.block_size)
    if spec.family == "bert":
        family = dict(lm, type_vocab_size=1, pad_token_id=data.PAD_ID)
    elif spec.family == "gpt2":
        family = dict(lm, summary_first_dropout=0.0, **tokens)
    elif spec.family == "vit":
        family = dict(image_size=data.DIGIT_IMAGE_SIZE, channels=1, num_labels=data.NUM_DIGIT_CLASSES)
    else:  # llama, mixtral
        family = dict(lm, kv_heads=s.kv_heads or s.heads, tie_word_embeddings=False, **tokens)
    # architectures=None: the configs stay as the checkpoint fingerprints recorded them
    return {**sizes, **family, "architectures": None, **spec.extra}


def make_config(arch: str, size: str = "quick"):
    """The Hugging Face config of zoo model ``arch`` at ``size``."""
    spec = get_spec(arch)
    return models.config(spec.family, **_overrides(spec, size))


def model_class(arch: str) -> type:
    return models.model_class(get_spec(arch).family)


def build_model(arch: str, seed: int, size: str = "quick") -> torch.nn.Module:
    """Zoo model ``arch`` at ``size`` initialised from ``seed``, in ``eval()`` mode, CPU, float32."""
    spec = get_spec(arch)
    return models.build(spec.family, seed, attn_implementation=ATTN_IMPLEMENTATION, **_overrides(spec, size))

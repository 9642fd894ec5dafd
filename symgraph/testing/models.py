"""Tiny random-weight models, built from configs (no download): the one place that builds them
for the tests, the benchmarks, ``symgraph demo``, the CLI's ``tiny-*`` models and
``python -m symgraph.cli.examples``.

* :func:`config` returns a Hugging Face config of one of :data:`ARCHS`, from small default
  sizes (:data:`TINY`) and keyword overrides: the sizes by short names (``hidden``,
  ``layers``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``positions``, ``image_size``,
  ``patch_size``, ``channels``, ``num_labels``; ``experts`` for the mixture-of-experts
  ``mixtral``, whose ``mlp`` is one expert's width), ``attn_implementation``, ``dropout``,
  ``use_cache``, and any other field of the config by its own name (``rope_theta=...``).
* :func:`build` builds the model from that config, seeded, in ``eval()`` mode.
* :func:`randomize_vectors`, :func:`transformer_encoder` and :func:`mlp` make the
  non-Hugging-Face test models (and give 1-d parameters values a permutation can see).
* :func:`train` is the training loop (AdamW, gradient clipping, optional LR schedule such as
  :func:`warmup_cosine`, optional progress callback, a step and/or time budget) of both
  ``benchmarks/train.py`` and :mod:`symgraph.cli.demo`.

Conventions of ``base="tiny"`` (the default): dropout 0 (:data:`DROPOUT_FIELDS`); decoders
have ``use_cache=False`` and special tokens (bos, eos, pad) 0, inside the tiny vocabulary;
attention is ``"sdpa"`` (GPT-J: ``"eager"``, it has no SDPA path). ``base="hf"`` keeps every
Hugging Face default that is not overridden (what the CLI's ``tiny-*`` models and the
examples have always been). Either way ``config.architectures`` names the model class, so
a ``save_pretrained`` directory loads back, and the same seed gives bit-identical weights.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = ["randomized", "ARCHS", "DECODERS", "MODEL_CLASSES", "TINY", "DROPOUT_FIELDS", "ATTN_IMPLEMENTATION",
           "config", "model_class", "build", "randomize_vectors", "transformer_encoder", "mlp",
           "train", "warmup_cosine"]

#: Attention backend of ``base="tiny"`` configs (GPT-J: ``"eager"``).
ATTN_IMPLEMENTATION = "sdpa"

#: Architecture -> (config class, default model class), both names in ``transformers``.
_CLASSES = {
    "bert": ("BertConfig", "BertForMaskedLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "vit": ("ViTConfig", "ViTForImageClassification"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM"),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
#: The architectures :func:`config` and :func:`build` know.
ARCHS = tuple(_CLASSES)
#: Architecture -> name of the default model class (a head for a tiny task).
MODEL_CLASSES = {arch: cls for arch, (_, cls) in _CLASSES.items()}
#: Causal decoders: ``use_cache`` and special token ids apply.
DECODERS = frozenset({"gpt2", "llama", "phi", "gptj", "neox", "mixtral"})

# short size name -> config field, per architecture
_GPT_NAMES = {"vocab": "vocab_size", "hidden": "n_embd", "layers": "n_layer", "heads": "n_head",
              "mlp": "n_inner", "positions": "n_positions"}
_LM_NAMES = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "mlp": "intermediate_size",
             "positions": "max_position_embeddings"}
_SIZE_NAMES = {
    "bert": _LM_NAMES,
    "gpt2": _GPT_NAMES,
    "llama": {**_LM_NAMES, "kv_heads": "num_key_value_heads"},
    "vit": {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "mlp": "intermediate_size", "image_size": "image_size", "patch_size": "patch_size",
            "channels": "num_channels"},
    "phi": {**_LM_NAMES, "kv_heads": "num_key_value_heads"},
    "gptj": _GPT_NAMES,
    "neox": _LM_NAMES,
    # mlp: each expert's hidden width
    "mixtral": {**_LM_NAMES, "kv_heads": "num_key_value_heads", "experts": "num_local_experts"},
}

#: Default sizes (and architecture-specific fields) of ``base="tiny"``: two layers, 4 heads.
TINY: dict[str, dict[str, Any]] = {
    "bert": dict(vocab=64, hidden=16, layers=2, heads=4, mlp=24, positions=32),
    "gpt2": dict(vocab=64, hidden=16, layers=2, heads=4, mlp=40, positions=32),
    "llama": dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=32),
    "vit": dict(image_size=8, patch_size=4, channels=3, hidden=16, layers=2, heads=4, mlp=24,
                num_labels=3),
    "phi": dict(vocab=64, hidden=32, layers=2, heads=4, mlp=48, positions=32,
                partial_rotary_factor=0.5),
    "gptj": dict(vocab=64, hidden=32, layers=2, heads=4, rotary_dim=4, mlp=48, positions=32,
                 attn_implementation="eager"),
    "neox": dict(vocab=64, hidden=32, layers=2, heads=4, mlp=48, positions=32, rotary_pct=0.5),
    "mixtral": dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=24, positions=32,
                    experts=4, num_experts_per_tok=2),
}

#: The dropout probabilities of each architecture's backbone, set by ``dropout=``.
DROPOUT_FIELDS = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "phi": ("resid_pdrop", "embd_pdrop", "attention_dropout"),
    "gptj": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "neox": ("hidden_dropout", "attention_dropout"),
    "mixtral": ("attention_dropout",),
}

_UNSET = object()


def _transformers():
    import transformers
    return transformers


def _check_arch(arch: str) -> None:
    if arch not in _CLASSES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")


def model_class(arch: str, cls: str | type | None = None) -> type[Any]:
    """The ``transformers`` model class of ``arch``: ``cls`` (a class, or its name in
    ``transformers`` such as ``"ViTModel"``) or the default of :data:`MODEL_CLASSES`."""
    _check_arch(arch)
    if isinstance(cls, type):
        return cls
    name = cls or MODEL_CLASSES[arch]
    try:
        return getattr(_transformers(), name)
    except AttributeError:
        raise ValueError(f"transformers has no model class {name!r}") from None


def config(arch: str, *, base: str = "tiny", cls: str | type | None = None,
           dropout: float | None | Any = _UNSET, use_cache: bool | None | Any = _UNSET, **overrides):
    """A Hugging Face config of a tiny ``arch`` model.

    Parameters
    ----------
    arch : str
        One of :data:`ARCHS`.
    base : {"tiny", "hf"}
        ``"tiny"``: start from :data:`TINY` and the conventions of the module docstring;
        ``"hf"``: start from the Hugging Face defaults (give the sizes you want).
    cls : str or type, optional
        Model class recorded in ``config.architectures`` (default :data:`MODEL_CLASSES`);
        ``architectures=`` overrides the record itself.
    dropout : float or None, optional
        Every :data:`DROPOUT_FIELDS` probability (``base="tiny"``: 0); None keeps the
        Hugging Face defaults.
    use_cache : bool or None, optional
        Decoders only (``base="tiny"``: False); None keeps the Hugging Face default.
    **overrides
        Sizes by short name (``hidden``, ``layers``, ``heads``, ``kv_heads``, ``mlp``,
        ``vocab``, ``positions``, ``image_size``, ``patch_size``, ``channels``; see
        :data:`TINY`), or any config keyword (``num_labels``, ``attn_implementation``,
        ``rope_theta``, ``pad_token_id``, ...).

    Returns
    -------
    transformers.PretrainedConfig
    """
    _check_arch(arch)
    if base not in ("tiny", "hf"):
        raise ValueError(f"base must be 'tiny' or 'hf', got {base!r}")
    tiny = base == "tiny"
    decoder = arch in DECODERS
    kwargs: dict[str, Any] = {}
    if tiny:
        kwargs["attn_implementation"] = ATTN_IMPLEMENTATION
        if decoder:
            kwargs.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    dropout = (0.0 if tiny else None) if dropout is _UNSET else dropout
    if dropout is not None:
        kwargs.update(dict.fromkeys(DROPOUT_FIELDS[arch], float(dropout)))
    if use_cache is _UNSET:
        use_cache = False if tiny and decoder else None
    elif use_cache is not None and not decoder:
        raise ValueError(f"use_cache applies to decoders ({', '.join(sorted(DECODERS))}), not {arch!r}")
    if use_cache is not None:
        kwargs["use_cache"] = bool(use_cache)
    architectures = overrides.pop("architectures", [model_class(arch, cls).__name__])
    names = _SIZE_NAMES[arch]
    other_short = {short for table in _SIZE_NAMES.values() for short in table} - set(names)
    for key, value in {**(TINY[arch] if tiny else {}), **overrides}.items():
        if key in other_short:
            raise ValueError(f"{arch!r} has no size {key!r}; its sizes are {', '.join(names)}")
        kwargs[names.get(key, key)] = value
    cfg = getattr(_transformers(), _CLASSES[arch][0])(**kwargs)
    cfg.architectures = architectures
    return cfg


def build(arch: str, seed: int = 0, *, cls: str | type | None = None, device=None, **overrides):
    """A tiny random-weight ``arch`` model in ``eval()`` mode.

    ``torch.manual_seed(seed)`` runs right before construction, so the same arguments give
    bit-identical weights. ``cls`` picks the model class (see :func:`model_class`);
    ``device`` builds under ``torch.device(device)`` (``"meta"``: shapes only); every other
    keyword goes to :func:`config`.
    """
    cfg = config(arch, cls=cls, **overrides)
    klass = model_class(arch, cls)
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = klass._from_config(cfg)
    return model.eval()


# --- non-Hugging-Face test models ---------------------------------------------------------


def randomize_vectors(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every 1-d parameter in place (``*weight``: 1 + 0.5·N(0,1), else 0.5·N(0,1)).

    Hugging Face initialises norm weights to ones and biases to zeros, which every
    permutation leaves unchanged: random values let a test see a wrong bias or norm slot.
    Meta parameters are skipped. Returns ``model``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not p.is_meta:
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.5 * noise)
    return model


def randomized(model: torch.nn.Module, seed: int = 0, scale: float = 0.3,
               dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """Every parameter re-drawn as ``scale``·N(0, 1) (one generator seeded ``seed``, in
    parameter order, drawn in its own dtype), in ``eval()`` mode and ``dtype`` (default float64):
    a model whose function no initialiser's zeros or ones make special, for tests that transform
    and recover it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval().to(dtype)


def transformer_encoder(seed: int = 0, d: int = 16, heads: int = 4, ff: int = 40,
                        layers: int = 2) -> torch.nn.TransformerEncoder:
    """A ``torch.nn.TransformerEncoder`` (batch first, no dropout) in ``eval()`` mode."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


_ACTIVATIONS = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "silu": torch.nn.SiLU, "tanh": torch.nn.Tanh}


def mlp(seed: int = 0, widths: Iterable[int] = (6, 16, 12, 3),
        activations: Iterable[str] = ("relu", "gelu")) -> torch.nn.Sequential:
    """``Linear`` layers of ``widths`` with the ``activations`` (cycled) between them, in
    ``eval()`` mode."""
    widths, acts = list(widths), list(activations)
    if len(widths) < 2 or not acts:
        raise ValueError("mlp needs at least 2 widths and 1 activation")
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(_ACTIVATIONS[acts[(i - 1) % len(acts)]]())
        layers.append(torch.nn.Linear(n_in, n_out))
    return torch.nn.Sequential(*layers).eval()


# --- training -----------------------------------------------------------------------------


def warmup_cosine(total_steps: int, warmup_fraction: float = 0.05,
                  min_lr_fraction: float = 0.1) -> Callable[[int], float]:
    """LR factor of step ``i``: linear warm-up over ``warmup_fraction`` of the steps (at least
    one), then cosine decay to ``min_lr_fraction`` at ``total_steps``."""
    warmup = max(1, int(round(warmup_fraction * total_steps)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_fraction + (1.0 - min_lr_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _default_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _adamw(model, lr, betas, weight_decay, decay_vectors):
    """AdamW over ``model``'s trainable parameters, decaying the matrices (and the vectors too
    if ``decay_vectors``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_vectors:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def _step(model, loss, opt, sched, grad_clip) -> float:
    """One optimizer step on ``loss``; returns its value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    if sched is not None:
        sched.step()
    return loss.detach().item()


def train(model: torch.nn.Module, sample_batch: Callable[[], Any], *, steps: int | None = None,
          seconds: float | None = None, lr: float = 1e-3,
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = _default_loss,
          weight_decay: float = 0.01, decay_vectors: bool = False,
          betas: tuple[float, float] = (0.9, 0.999), grad_clip: float | None = 1.0,
          schedule: Callable[[int], float] | None = None,
          progress: Callable[[int, float, float], None] | None = None,
          threads: int | None = None) -> list[float]:
    """Train ``model`` in place with AdamW; return the per-step training losses.

    Parameters
    ----------
    model : torch.nn.Module
        Put in ``train()`` mode for the loop and in ``eval()`` mode after it.
    sample_batch : callable
        No-argument callable returning the next batch (it owns its random generator).
    steps, seconds : optional
        Budget: stop after ``steps`` optimizer steps and/or once ``seconds`` have passed
        (checked before each step). At least one is required.
    lr : float
        Peak learning rate.
    loss_fn : callable
        ``loss_fn(model, batch)`` -> scalar loss; default ``model(**batch).loss``.
    weight_decay : float
        AdamW weight decay of the matrices (``ndim >= 2``), and of the vectors too if
        ``decay_vectors``.
    betas : (float, float)
        AdamW betas.
    grad_clip : float or None
        Max gradient norm (None: no clipping).
    schedule : callable, optional
        LR factor of step ``i`` (``torch.optim.lr_scheduler.LambdaLR``), e.g.
        :func:`warmup_cosine`.
    progress : callable, optional
        ``progress(step, loss, elapsed_seconds)`` after every step (``step`` counts from 1).
    threads : int, optional
        ``torch.set_num_threads`` for the loop (restored after).
    """
    if steps is None and seconds is None:
        raise ValueError("train needs a budget: steps and/or seconds")
    opt = _adamw(model, lr, betas, weight_decay, decay_vectors)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule is not None else None
    losses: list[float] = []
    start = time.perf_counter()

    def budget_left() -> bool:
        return ((steps is None or len(losses) < steps)
                and (seconds is None or time.perf_counter() - start < seconds))

    with _threads(threads), _training(model):
        while budget_left():
            losses.append(_step(model, loss_fn(model, sample_batch()), opt, sched, grad_clip))
            if progress is not None:
                progress(len(losses), losses[-1], time.perf_counter() - start)
    return losses


@contextlib.contextmanager
def _threads(n):
    """``torch.set_num_threads(n)`` inside (nothing when None), restored after."""
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(previous)


@contextlib.contextmanager
def _training(model):
    """``model`` in ``train()`` mode inside, in ``eval()`` mode after."""
    model.train()
    try:
        yield
    finally:
        model.eval()

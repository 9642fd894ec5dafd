"""Offline datasets for the benchmark suite, from data that ships with Python or the installed
packages: ``"prose"``, the values of :data:`pydoc_data.topics.topics` in sorted key order;
``"code"``, the standard library's top-level ``.py`` files in name order (the first
:data:`CODE_MAX_CHARS` characters); ``"digits"``, :func:`sklearn.datasets.load_digits`, 1797 8x8
images as float32 ``(n, 1, 8, 8)`` in [-1, 1].

Splits never depend on a model's seed: text is split by characters, the last
:data:`EVAL_FRACTION` (moved to the next line break) held out as ``"eval"``; the digits are
permuted with :data:`SPLIT_SEED` and the last :data:`EVAL_FRACTION` held out. Each text corpus
has a byte-level BPE tokenizer trained on its train split, :data:`VOCAB_SIZE` entries with
``[PAD]`` = 0 and ``[MASK]`` = 1, cached under ``<cache_dir()>/tokenizers``.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

TEXT_CORPORA = ("prose", "code")
VOCAB_SIZE = 512
#: Special tokens, in id order.
SPECIAL_TOKENS = ("[PAD]", "[MASK]")
PAD_ID, MASK_ID = 0, 1
EVAL_FRACTION = 0.1
SPLIT_SEED = 1234
CODE_MAX_CHARS = 1_000_000
#: BERT masking rate and the mask / random / keep proportions of masked tokens (80/10/10).
MLM_PROBABILITY = 0.15
MLM_MASK_FRACTION = 0.8
MLM_RANDOM_FRACTION = 0.1
NUM_DIGIT_CLASSES = 10
DIGIT_IMAGE_SIZE = 8
#: Bump to invalidate cached tokenizers after a change in how they are built.
_TOKENIZER_VERSION = 1


def cache_dir() -> Path:
    """The suite's cache directory, created if needed: ``$SYMGRAPH_CACHE`` (read at every call),
    else ``~/.cache/symgraph``."""
    path = Path(os.environ.get("SYMGRAPH_CACHE") or os.path.join("~", ".cache", "symgraph")).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check(value: str, allowed: tuple, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=None)
def corpus_text(corpus: str) -> str:
    """The whole raw text of ``corpus``, deterministic for a given Python installation."""
    _check(corpus, TEXT_CORPORA, "corpus")
    if corpus == "prose":
        import pydoc_data.topics
        topics = pydoc_data.topics.topics
        return "\n\n".join(topics[key].strip("\n") for key in sorted(topics)) + "\n"
    parts, total = [], 0
    for path in sorted(Path(os.__file__).resolve().parent.glob("*.py")):
        if total >= CODE_MAX_CHARS:
            break
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
    return "".join(parts)[:CODE_MAX_CHARS]


def split_text(corpus: str, split: str) -> str:
    """``split`` of ``corpus``: "eval" the last :data:`EVAL_FRACTION` of the characters, from a
    line start; "train" the rest."""
    _check(split, ("train", "eval"), "split")
    text = corpus_text(corpus)
    newline = text.find("\n", int(len(text) * (1.0 - EVAL_FRACTION)))
    cut = len(text) if newline < 0 else newline + 1
    return text[:cut] if split == "train" else text[cut:]


@functools.lru_cache(maxsize=None)
def get_tokenizer(corpus: str, vocab_size: int = VOCAB_SIZE):
    """The byte-level BPE tokenizer of ``corpus``'s train split, from the on-disk cache, else
    trained (well under a second) and written atomically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check(corpus, TEXT_CORPORA, "corpus")
    text = split_text(corpus, "train")
    path = cache_dir() / "tokenizers" / f"{corpus}-bpe{vocab_size}-v{_TOKENIZER_VERSION}-{_sha(text)[:12]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return tokenizer


@functools.lru_cache(maxsize=None)
def _token_ids_cached(corpus: str, split: str) -> torch.Tensor:
    # line by line, as the tokenizer was trained (and much faster than one huge string)
    lines = split_text(corpus, split).splitlines(keepends=True)
    return torch.tensor([i for enc in get_tokenizer(corpus).encode_batch(lines) for i in enc.ids], dtype=torch.long)


def token_ids(corpus: str, split: str) -> torch.Tensor:
    """The token ids of ``split`` of ``corpus``, 1-D (a fresh clone: safe to modify)."""
    return _token_ids_cached(corpus, split).clone()


def token_blocks(corpus: str, split: str, block_size: int) -> torch.Tensor:
    """:func:`token_ids` cut into consecutive blocks, ``(n_blocks, block_size)`` (the shorter
    remainder dropped): the deterministic layout of evaluation."""
    ids = _token_ids_cached(corpus, split)
    n = len(ids) // block_size
    return ids[: n * block_size].reshape(n, block_size).clone()


def random_blocks(corpus: str, split: str, block_size: int, batch_size: int,
                  generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` blocks of :func:`token_ids` at random offsets drawn from ``generator``:
    training's batches."""
    ids = _token_ids_cached(corpus, split)
    starts = torch.randint(0, len(ids) - block_size + 1, (batch_size,), generator=generator)
    return ids[starts[:, None] + torch.arange(block_size)]


def mlm_mask(input_ids: torch.Tensor, seed: int | None = None, *, generator: torch.Generator | None = None,
             mlm_probability: float = MLM_PROBABILITY,
             vocab_size: int = VOCAB_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked ids, labels)``: BERT-style masking of ``input_ids`` (not modified). Each
    non-special token is selected with probability ``mlm_probability``; of those 80% become
    ``[MASK]``, 10% a uniformly random non-special token, 10% stay. Labels: the original id where
    selected, -100 elsewhere. Exactly one of ``seed`` (a fresh generator) and ``generator``
    (advanced in place, e.g. per-step dynamic masking in training)."""
    if (seed is None) == (generator is None):
        raise ValueError("give exactly one of seed and generator")
    if generator is None:
        generator = torch.Generator().manual_seed(int(seed))
    n_special, shape = len(SPECIAL_TOKENS), input_ids.shape
    selected = (torch.rand(shape, generator=generator) < mlm_probability) & ~(input_ids < n_special)
    action = torch.rand(shape, generator=generator)
    random_ids = torch.randint(n_special, vocab_size, shape, generator=generator)
    to_mask = selected & (action < MLM_MASK_FRACTION)
    to_random = selected & (action >= MLM_MASK_FRACTION) & (action < MLM_MASK_FRACTION + MLM_RANDOM_FRACTION)
    masked = input_ids.clone()
    masked[to_mask] = MASK_ID
    masked[to_random] = random_ids[to_random]
    return masked, torch.where(selected, input_ids, torch.full_like(input_ids, -100))


@functools.lru_cache(maxsize=None)
def _digits_cached() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    from sklearn.datasets import load_digits
    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0 * 2.0 - 1.0
    x = torch.from_numpy(images).reshape(-1, 1, DIGIT_IMAGE_SIZE, DIGIT_IMAGE_SIZE)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    return x, y, np.random.default_rng(SPLIT_SEED).permutation(len(y))


def digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (n, 1, 8, 8) in [-1, 1], labels (n,))`` of one split of the digits: "eval" the
    last :data:`EVAL_FRACTION` (rounded up) of the fixed permutation, "train" the rest."""
    _check(split, ("train", "eval"), "split")
    x, y, perm = _digits_cached()
    n_eval = int(np.ceil(len(perm) * EVAL_FRACTION))
    idx = perm[: len(perm) - n_eval] if split == "train" else perm[len(perm) - n_eval:]
    idx = torch.from_numpy(np.sort(idx))
    return x[idx].clone(), y[idx].clone()


@functools.lru_cache(maxsize=None)
def data_fingerprint(dataset: str) -> str:
    """12 hexadecimal characters naming the exact contents of ``dataset``: in cache keys, so that
    checkpoints trained on another Python installation's data are never reused."""
    if dataset == "digits":
        h = hashlib.sha256()
        for arr in _digits_cached():
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()[:12]
    _check(dataset, TEXT_CORPORA, "corpus")
    return _sha(f"{VOCAB_SIZE}|{EVAL_FRACTION}|{corpus_text(dataset)}")[:12]

"""Byte-level BPE tokenizers of the text corpora, token streams and blocks, and BERT-style
masking of token ids (see :mod:`benchmarks.data`)."""

from __future__ import annotations

import functools
import os

import torch

from .common import (MASK_ID, MASK_TOKEN, MLM_MASK_FRACTION, MLM_PROBABILITY, MLM_RANDOM_FRACTION, PAD_ID, PAD_TOKEN,
                     SPECIAL_TOKENS, VOCAB_SIZE, _TOKENIZER_VERSION, _check_corpus, _check_split, _sha, cache_dir)
from .text import split_text


def _train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


@functools.lru_cache(maxsize=None)
def get_tokenizer(corpus: str, vocab_size: int = VOCAB_SIZE):
    """The byte-level BPE tokenizer of ``corpus``'s "train" split (``vocab_size`` entries, the
    special tokens included: ``[PAD]`` = 0, ``[MASK]`` = 1; ``decode(encode(s)) == s``), from the
    on-disk cache, else trained (well under a second) and written atomically."""
    from tokenizers import Tokenizer

    _check_corpus(corpus)
    text = split_text(corpus, "train")
    name = f"{corpus}-bpe{vocab_size}-v{_TOKENIZER_VERSION}-{_sha(text)[:12]}.json"
    path = cache_dir() / "tokenizers" / name
    if path.exists():
        tokenizer = Tokenizer.from_file(str(path))
    else:
        tokenizer = _train_tokenizer(text, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tokenizer.save(str(tmp))
        os.replace(tmp, path)
    assert tokenizer.token_to_id(PAD_TOKEN) == PAD_ID
    assert tokenizer.token_to_id(MASK_TOKEN) == MASK_ID
    return tokenizer


@functools.lru_cache(maxsize=None)
def _token_ids_cached(corpus: str, split: str) -> torch.Tensor:
    tokenizer = get_tokenizer(corpus)
    text = split_text(corpus, split)
    # Encode line by line, exactly as the tokenizer was trained (line-level
    # pieces); batching the lines is also much faster than one huge string.
    lines = text.splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines) for i in enc.ids]
    tensor = torch.tensor(ids, dtype=torch.long)
    tensor.requires_grad_(False)
    return tensor


def token_ids(corpus: str, split: str) -> torch.Tensor:
    """The token ids of ``split`` ("train" or "eval") of ``corpus`` ("prose" or "code"), 1-D (a
    fresh clone: safe to modify)."""
    _check_corpus(corpus)
    _check_split(split)
    return _token_ids_cached(corpus, split).clone()


def token_blocks(corpus: str, split: str, block_size: int) -> torch.Tensor:
    """:func:`token_ids` cut into consecutive blocks, ``(n_blocks, block_size)`` (the shorter
    remainder dropped): the deterministic layout of evaluation."""
    ids = _token_ids_cached(corpus, split)
    n = len(ids) // block_size
    return ids[: n * block_size].reshape(n, block_size).clone()


def random_blocks(corpus: str, split: str, block_size: int, batch_size: int,
                  generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` blocks of :func:`token_ids` at random offsets, ``(batch_size, block_size)``:
    training's batches, their order fully determined by ``generator`` (advanced in place)."""
    ids = _token_ids_cached(corpus, split)
    starts = torch.randint(0, len(ids) - block_size + 1, (batch_size,), generator=generator)
    return ids[starts[:, None] + torch.arange(block_size)]


def mlm_mask(input_ids: torch.Tensor, seed: int | None = None, *, generator: torch.Generator | None = None,
             mlm_probability: float = MLM_PROBABILITY,
             vocab_size: int = VOCAB_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked ids, labels)``: BERT-style masking of ``input_ids`` (any shape; not modified).
    Each non-special token is selected with probability ``mlm_probability``; of those 80% become
    ``[MASK]``, 10% a uniformly random non-special token below ``vocab_size``, 10% stay. Labels:
    the original id where selected, -100 (ignored by the loss) elsewhere. Exactly one of ``seed``
    (a fresh generator: a deterministic function of ``(input_ids, seed)``) and ``generator``
    (advanced in place, e.g. per-step dynamic masking in training)."""
    if (seed is None) == (generator is None):
        raise ValueError("give exactly one of seed and generator")
    if generator is None:
        generator = torch.Generator().manual_seed(int(seed))
    n_special = len(SPECIAL_TOKENS)
    shape = input_ids.shape
    is_special = input_ids < n_special
    selected = (torch.rand(shape, generator=generator) < mlm_probability) & ~is_special
    action = torch.rand(shape, generator=generator)
    random_ids = torch.randint(n_special, vocab_size, shape, generator=generator)
    to_mask = selected & (action < MLM_MASK_FRACTION)
    to_random = selected & (action >= MLM_MASK_FRACTION) & (
        action < MLM_MASK_FRACTION + MLM_RANDOM_FRACTION
    )
    masked = input_ids.clone()
    masked[to_mask] = MASK_ID
    masked[to_random] = random_ids[to_random]
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    return masked, labels

"""Tiny Shakespeare data, model config and evaluation of the Theus et al. (2025) protocol.

Mirrors the authors' release (antoniohonsell/Generalized-LMC-for-Transformers, commit 6b207cc):

* ``create_splits.py --method contiguous --val_frac 0.05 --test_frac 0.05``: the text is cut by
  *character* offset, ``test_n = round(n * 0.05)``, ``val_n = round(n * 0.05)``; train is the
  first ``n - val_n - test_n`` characters, then validation, then test (the tail).
* ``train.py``: each split is tokenized as ONE string with the GPT-2 BPE tokenizer (no BOS/EOS
  added), the ids are cut into non-overlapping chunks of ``block_size = 256`` starting at token
  0, and the trailing partial chunk is dropped (HF ``group_texts``).
* the loss is Hugging Face's causal-LM loss: labels = inputs (the collator would mask pad = EOS
  tokens, which the corpus never produces), shifted by one, so each 256-token sequence gives 255
  predictions; the Trainer's ``eval_loss`` is then the mean cross-entropy over all predicted
  tokens of the split (every sequence has the same 255 targets).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator

import torch
from torch.nn import functional as F

BLOCK_SIZE = 256
VAL_FRAC = 0.05
TEST_FRAC = 0.05
SPLITS = ("train", "validation", "test")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


class AnchorError(Exception):
    """A user-facing error with a one-line message (missing corpus/tokenizer, bad arguments)."""


def default_cache() -> Path:
    """``$SYMGRAPH_CACHE/anchor``, or ``~/.cache/symgraph/anchor``."""
    root = os.environ.get("SYMGRAPH_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "symgraph"
    return base / "anchor"


def _check_corpus(corpus: str | os.PathLike) -> Path:
    p = Path(corpus)
    if not p.is_file():
        raise AnchorError(f"corpus file not found: {p}")
    return p


def _check_tokenizer_dir(tokenizer_dir: str | os.PathLike) -> Path:
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise AnchorError(f"tokenizer directory not found: {d}")
    if not (d / "tokenizer.json").is_file() and not (
        (d / "vocab.json").is_file() and (d / "merges.txt").is_file()
    ):
        raise AnchorError(f"tokenizer directory has no tokenizer.json or vocab.json+merges.txt: {d}")
    return d


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    """The GPT-2 BPE tokenizer (``GPT2TokenizerFast``) from a local directory."""
    from transformers import GPT2TokenizerFast

    d = _check_tokenizer_dir(tokenizer_dir)
    tok = GPT2TokenizerFast.from_pretrained(str(d))
    tok.model_max_length = int(1e12)  # whole splits are tokenized at once; silence the warning
    tok.pad_token = tok.eos_token  # as the authors' train.py
    return tok


def split_text(text: str, val_frac: float = VAL_FRAC, test_frac: float = TEST_FRAC) -> tuple[str, str, str]:
    """Contiguous character split ``(train, validation, test)`` exactly as the authors'
    ``contiguous_splits_from_text``: the sizes of validation and test are rounded, train is the rest."""
    n = len(text)
    if n == 0:
        raise AnchorError("corpus is empty")
    test_n = int(round(n * test_frac))
    val_n = int(round(n * val_frac))
    hold = val_n + test_n
    if hold >= n:
        raise AnchorError("validation + test fractions leave no training text")
    return text[: n - hold], text[n - hold: n - test_n], text[n - test_n:]


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """Token ids of ``text`` tokenized as one string, a 1-d int64 tensor."""
    ids = tokenizer(text, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _digest(corpus: Path, tokenizer_dir: Path, val_frac: float, test_frac: float) -> str:
    h = hashlib.sha256()
    h.update(corpus.read_bytes())
    for name in _TOKENIZER_FILES:
        f = tokenizer_dir / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    h.update(f"{val_frac!r}/{test_frac!r}".encode())
    return h.hexdigest()[:16]


def load_splits(
    corpus: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    cache: str | os.PathLike | None = None,
    val_frac: float = VAL_FRAC,
    test_frac: float = TEST_FRAC,
) -> dict[str, torch.Tensor]:
    """``{"train", "validation", "test"}`` -> 1-d int64 token ids of each contiguous split.

    The token tensors are cached in ``cache`` (default :func:`default_cache`) under a name keyed by
    the sha256 of the corpus, the tokenizer files and the fractions; pass ``cache=False`` to skip."""
    corpus_p = _check_corpus(corpus)
    tok_dir = _check_tokenizer_dir(tokenizer_dir)
    path = None
    if cache is not False:
        cdir = Path(cache) if cache is not None else default_cache()
        path = cdir / f"tokens-{_digest(corpus_p, tok_dir, val_frac, test_frac)}.pt"
        if path.is_file():
            d = torch.load(path, map_location="cpu")
            return {k: d[k].long() for k in SPLITS}
    text = corpus_p.read_text(encoding="utf-8")
    tok = load_tokenizer(tok_dir)
    parts = split_text(text, val_frac, test_frac)
    out = {k: tokenize(t, tok) for k, t in zip(SPLITS, parts)}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        torch.save({k: v.to(torch.int32) for k, v in out.items()}, tmp)
        os.replace(tmp, path)
    return out


def sequences(ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Non-overlapping ``[n, block_size]`` chunks of 1-d ``ids`` from token 0; the trailing
    partial chunk is dropped (the authors' ``group_texts``). A 2-d input is returned as is."""
    if ids.dim() == 2:
        return ids
    n = (ids.numel() // block_size) * block_size
    return ids[:n].reshape(-1, block_size)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled sequence order of one epoch: a permutation drawn from a generator seeded by
    ``(seed, epoch)``, so that it can be recomputed when resuming mid-epoch."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=g)


def steps_per_epoch(n_sequences: int, batch_size: int) -> int:
    """Batches per epoch; the last partial batch is kept (HF Trainer, ``dataloader_drop_last=False``)."""
    return -(-n_sequences // batch_size)


def batches(
    seqs: torch.Tensor, batch_size: int, seed: int | None = None, epoch: int = 0, start: int = 0
) -> Iterator[torch.Tensor]:
    """Batches of ``seqs`` (``[n, L]``): in order when ``seed`` is None, otherwise in the order of
    :func:`epoch_order`; the last batch may be smaller. ``start`` skips that many batches."""
    n = seqs.shape[0]
    order = None if seed is None else epoch_order(n, seed, epoch).to(seqs.device)  # drawn on the CPU
    for b in range(start, steps_per_epoch(n, batch_size)):
        sl = slice(b * batch_size, (b + 1) * batch_size)
        yield seqs[sl] if order is None else seqs[order[sl]]


def config(vocab_size: int = 50257, block_size: int = BLOCK_SIZE, **overrides):
    """The protocol's ``GPT2Config``: untied embeddings, 6 layers, 4 heads, width 256, MLP 1024,
    ``gelu_new``, dropout 0.1 (residual, embedding, attention), 256 positions. ``overrides`` replace
    any field (e.g. a tiny model for tests)."""
    from transformers import GPT2Config

    kw = dict(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_embd=256,
        n_layer=6,
        n_head=4,
        n_inner=1024,
        tie_word_embeddings=False,
        activation_function="gelu_new",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    kw.update(overrides)
    return GPT2Config(**kw)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Causal-LM cross-entropy (fp32): position t predicts token t+1; mean over all predictions."""
    logits = logits[:, :-1, :].float()
    target = input_ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction)


@torch.no_grad()
def test_loss(model, split: torch.Tensor, batch_size: int = 8, block_size: int = BLOCK_SIZE) -> float:
    """Mean token cross-entropy of ``model`` over the sequences of ``split`` (1-d ids, cut with
    :func:`sequences`, or ``[n, L]``), in eval mode (no dropout) and float32, no autocast. Equals
    the authors' Trainer ``eval_loss`` (all sequences have the same number of targets). Computed
    on the model's device (the batches moved there), summed there in float64, read once."""
    seqs = sequences(split, block_size)
    if seqs.shape[0] == 0:
        raise AnchorError("split has no complete sequence")
    p = next(iter(model.parameters()), None)
    dev = p.device if p is not None else seqs.device
    was_training = model.training
    model.eval()
    total, count = None, 0
    try:
        with torch.autocast(dev.type if dev.type in ("cpu", "cuda") else "cpu", enabled=False):
            for xb in batches(seqs, batch_size):
                xb = xb.to(dev)
                s = lm_loss(model(input_ids=xb).logits, xb, reduction="sum").double()
                total = s if total is None else total + s
                count += xb.shape[0] * (xb.shape[1] - 1)
    finally:
        model.train(was_training)
    return float(total) / count

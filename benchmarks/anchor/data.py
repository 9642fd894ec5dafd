"""Tiny Shakespeare data, model config and evaluation of the Theus et al. (2025) protocol.

Mirrors the authors' release (antoniohonsell/Generalized-LMC-for-Transformers, commit 6b207cc):

* ``create_splits.py --method contiguous --val_frac 0.05 --test_frac 0.05``: the text is cut by
  *character* offset, ``test_n = round(n * 0.05)``, ``val_n = round(n * 0.05)``; train is the
  first ``n - val_n - test_n`` characters, then validation, then test (the tail).
* ``train.py``: each split is tokenized as ONE string with the GPT-2 BPE tokenizer (no BOS/EOS
  added), the ids are cut into non-overlapping chunks of ``block_size = 256`` starting at token
  0, and the trailing partial chunk is dropped (HF ``group_texts``).
* the loss is Hugging Face's causal-LM loss: labels = inputs shifted by one (255 predictions per
  256-token sequence); the Trainer's ``eval_loss`` is the mean cross-entropy over all predicted
  tokens of the split.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch.nn import functional as F

BLOCK_SIZE = 256
VAL_FRAC = 0.05
TEST_FRAC = 0.05
SPLITS = ("train", "validation", "test")


class AnchorError(Exception):
    """A user-facing error with a one-line message (missing corpus/tokenizer, bad arguments)."""


def default_cache() -> Path:
    """``$SYMGRAPH_CACHE/anchor``, or ``~/.cache/symgraph/anchor``."""
    root = os.environ.get("SYMGRAPH_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "symgraph") / "anchor"


def _tokenizer_dir(tokenizer_dir) -> Path:
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise AnchorError(f"tokenizer directory not found: {d}")
    if not (d / "tokenizer.json").is_file() and not ((d / "vocab.json").is_file() and (d / "merges.txt").is_file()):
        raise AnchorError(f"tokenizer directory has no tokenizer.json or vocab.json+merges.txt: {d}")
    return d


def load_tokenizer(tokenizer_dir):
    """The GPT-2 BPE tokenizer (``GPT2TokenizerFast``) from a local directory."""
    from transformers import GPT2TokenizerFast
    tok = GPT2TokenizerFast.from_pretrained(str(_tokenizer_dir(tokenizer_dir)))
    tok.model_max_length = int(1e12)  # whole splits are tokenized at once; silence the warning
    tok.pad_token = tok.eos_token  # as the authors' train.py
    return tok


def split_text(text: str, val_frac: float = VAL_FRAC, test_frac: float = TEST_FRAC) -> tuple[str, str, str]:
    """Contiguous character split ``(train, validation, test)`` exactly as the authors'
    ``contiguous_splits_from_text``: the sizes of validation and test are rounded, train is the rest."""
    n = len(text)
    test_n, val_n = int(round(n * test_frac)), int(round(n * val_frac))
    if val_n + test_n >= n:
        raise AnchorError("the corpus is empty, or validation + test leave no training text")
    return text[: n - val_n - test_n], text[n - val_n - test_n: n - test_n], text[n - test_n:]


def load_splits(corpus, tokenizer_dir, cache=None, val_frac: float = VAL_FRAC,
                test_frac: float = TEST_FRAC) -> dict[str, torch.Tensor]:
    """``{"train", "validation", "test"}`` -> 1-d int64 token ids of each contiguous split, each
    split tokenized as one string. Cached in ``cache`` (default :func:`default_cache`; ``False``:
    none) under the sha256 of the corpus, the tokenizer files and the fractions."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise AnchorError(f"corpus file not found: {corpus}")
    tok_dir = _tokenizer_dir(tokenizer_dir)
    path = None
    if cache is not False:
        h = hashlib.sha256(corpus.read_bytes())
        for name in ("tokenizer.json", "vocab.json", "merges.txt"):
            if (tok_dir / name).is_file():
                h.update(name.encode() + (tok_dir / name).read_bytes())
        h.update(f"{val_frac!r}/{test_frac!r}".encode())
        path = (Path(cache) if cache is not None else default_cache()) / f"tokens-{h.hexdigest()[:16]}.pt"
        if path.is_file():
            d = torch.load(path, map_location="cpu")
            return {k: d[k].long() for k in SPLITS}
    tok = load_tokenizer(tok_dir)
    parts = split_text(corpus.read_text(encoding="utf-8"), val_frac, test_frac)
    out = {k: torch.tensor(tok(t, return_attention_mask=False)["input_ids"], dtype=torch.long)
           for k, t in zip(SPLITS, parts)}
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
    return ids[: (ids.numel() // block_size) * block_size].reshape(-1, block_size)


def steps_per_epoch(n_sequences: int, batch_size: int) -> int:
    """Batches per epoch; the last partial batch is kept (HF Trainer, ``dataloader_drop_last=False``)."""
    return -(-n_sequences // batch_size)


def batches(seqs: torch.Tensor, batch_size: int, seed: int | None = None, epoch: int = 0, start: int = 0):
    """Batches of ``seqs`` (``[n, L]``), from batch ``start``: in order when ``seed`` is None, else
    in the epoch's shuffled order (a CPU generator seeded by ``(seed, epoch)``, so that a resumed
    run draws it again); the last batch may be smaller."""
    n = seqs.shape[0]
    order = None
    if seed is not None:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch)))
        order = order.to(seqs.device)
    for b in range(start, steps_per_epoch(n, batch_size)):
        sl = slice(b * batch_size, (b + 1) * batch_size)
        yield seqs[sl] if order is None else seqs[order[sl]]


def config(vocab_size: int = 50257, block_size: int = BLOCK_SIZE, **overrides):
    """The protocol's ``GPT2Config``: untied embeddings, 6 layers, 4 heads, width 256, MLP 1024,
    ``gelu_new``, dropout 0.1 (residual, embedding, attention), 256 positions; ``overrides``
    replace any field."""
    from transformers import GPT2Config
    kw = dict(vocab_size=vocab_size, n_positions=block_size, n_embd=256, n_layer=6, n_head=4, n_inner=1024,
              tie_word_embeddings=False, activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1,
              attn_pdrop=0.1)
    return GPT2Config(**{**kw, **overrides})


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Causal-LM cross-entropy (fp32): position t predicts token t+1; mean over all predictions."""
    logits = logits[:, :-1, :].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction=reduction)


@torch.no_grad()
def test_loss(model, split: torch.Tensor, batch_size: int = 8, block_size: int = BLOCK_SIZE) -> float:
    """Mean token cross-entropy of ``model`` over the sequences of ``split`` (1-d ids, cut with
    :func:`sequences`, or ``[n, L]``), in eval mode (no dropout) and float32, no autocast: the
    authors' Trainer ``eval_loss``. Summed on the model's device in float64, read once."""
    seqs = sequences(split, block_size)
    if seqs.shape[0] == 0:
        raise AnchorError("split has no complete sequence")
    p = next(iter(model.parameters()), None)  # none in a model widened in memory (circuit space)
    dev = p.device if p is not None else seqs.device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.autocast(dev.type if dev.type in ("cpu", "cuda") else "cpu", enabled=False):
            for xb in batches(seqs, batch_size):
                xb = xb.to(dev)
                total = total + lm_loss(model(input_ids=xb).logits, xb, reduction="sum").double()
                count += xb.shape[0] * (xb.shape[1] - 1)
    finally:
        model.train(was_training)
    return float(total) / count

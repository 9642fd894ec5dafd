"""The text corpora (``"prose"``, ``"code"``) and their train/eval split by characters (see
:mod:`benchmarks.data`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .common import CODE_MAX_CHARS, EVAL_FRACTION, _check_corpus, _check_split


def _prose_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key].strip("\n") for key in sorted(topics)) + "\n"


def _code_text(max_chars: int = CODE_MAX_CHARS) -> str:
    stdlib = Path(os.__file__).resolve().parent
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
    return "".join(parts)[:max_chars]


@functools.lru_cache(maxsize=None)
def corpus_text(corpus: str) -> str:
    """The whole raw text of ``corpus`` ("prose" or "code", see :mod:`benchmarks.data`),
    deterministic for a given Python installation."""
    _check_corpus(corpus)
    return _prose_text() if corpus == "prose" else _code_text()


def _split_point(text: str) -> int:
    """Character index where the held-out tail starts (at a line start)."""
    cut = int(len(text) * (1.0 - EVAL_FRACTION))
    newline = text.find("\n", cut)
    return len(text) if newline < 0 else newline + 1


def split_text(corpus: str, split: str) -> str:
    """``split`` of ``corpus``: the last :data:`EVAL_FRACTION` of the characters, from a line
    start, is "eval", the rest "train" (disjoint; together :func:`corpus_text`)."""
    _check_split(split)
    text = corpus_text(corpus)
    cut = _split_point(text)
    return text[:cut] if split == "train" else text[cut:]

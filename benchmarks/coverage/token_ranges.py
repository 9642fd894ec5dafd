"""Ranges of a vocabulary that hold a tokenizer's codes, kept inside the shrunk vocabulary
(issue 65; used by :mod:`.consistent`). A composite that turns images or audio into discrete
codes states where each code range begins (``image_token_offset``, ``audio_token_offset``) and
its tokenizers state how many codes they have (``codebook_size``); the ranges lie end to end in
the text vocabulary (Apertus 1.5's validator: ``image_token_offset + vision codebook_size ==
audio_token_offset`` and the audio range ends within ``text_config.vocab_size``). Shrinking the
vocabulary to 256 and leaving the rest breaks that; the rule reads the relation from the
defaults, never a family's name."""
from __future__ import annotations

from .tower_sizes import is_int

#: a shrunk tokenizer's codebook: its codes are the argmax of this many logits
CODEBOOK = 16


def _levels(fields: dict, out: dict):
    """``(name, old fields, shrunk dict)`` for the level itself (name None) and each sub-config."""
    yield None, fields, out
    for k, v in fields.items():
        if hasattr(v, "to_dict") and isinstance(out.get(k), dict):
            yield k, vars(v), out[k]


def _vocab(fields: dict, out: dict):
    """``(level, old, new)`` of the one vocabulary shrunk on this level or a sub-config."""
    found = [(name, old["vocab_size"], new.get("vocab_size", old["vocab_size"]))
             for name, old, new in _levels(fields, out)
             if is_int(old.get("vocab_size")) and old["vocab_size"] > 0]
    return found[0] if len(found) == 1 else None


def _chain(offsets: dict, books: dict, vocab: int) -> list | None:
    """The ranges end to end: ``[(offset field, codebook key), ...]`` in order, each range
    ending where the next begins and the last within ``vocab``; None where the defaults say
    otherwise or a codebook could pair with more than one range."""
    order = sorted(offsets, key=offsets.get)
    chain, used = [], set()
    for i, k in enumerate(order):
        end = offsets[order[i + 1]] if i + 1 < len(order) else None
        fits = [b for b, c in books.items() if b not in used
                and (offsets[k] + c == end if end is not None else offsets[k] + c <= vocab)]
        if len(fits) != 1:
            return None
        chain.append((k, fits[0]))
        used.add(fits[0])
    return chain


def code_ranges(fields: dict, out: dict, top: int | None = None) -> dict:
    """Each codebook shrunk to at most :data:`CODEBOOK` codes and each ``..._token_offset``
    placed so that the ranges lie end to end as in the defaults, the first at its default's
    share of the shrunk vocabulary, all below ``top`` (the lowest token id the shrink rule
    renumbered from the top; None: the vocabulary's end). Nothing where the level states no such ranges."""
    offsets = {k: v for k, v in fields.items() if is_int(v) and v > 0
               and k.endswith("_offset") and "token" in k.split("_")}
    vocab = _vocab(fields, out)
    if not offsets or vocab is None or vocab[1] <= vocab[2]:
        return {}
    books = {(name, k): v for name, old, _ in _levels(fields, out) for k, v in old.items()
             if k == "codebook_size" and is_int(v) and v > 0}
    chain = _chain(offsets, books, vocab[1])
    if chain is None:
        return {}
    sizes = {b: min(books[b], CODEBOOK) for _, b in chain}
    start = offsets[chain[0][0]] * vocab[2] // vocab[1]
    start = min(start, min(vocab[2] if top is None else top, vocab[2]) - sum(sizes.values()))
    if start < 0:
        return {}
    res: dict = {}
    for k, (name, field) in chain:
        res[k] = start
        start += sizes[(name, field)]
        if name is None:
            res[field] = sizes[(name, field)]
        else:
            res[name] = {**res.get(name, out[name]), field: sizes[(name, field)]}
    return res

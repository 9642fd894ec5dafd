"""A data file from text: ``symgraph data TEXT... --tokenizer DIR --out FILE``.

Text files are tokenised with a model's own tokenizer (a local directory, as ``save_pretrained``
writes it) into the data file every data-reading step takes (:doc:`data`): ``input_ids`` and
the ``attention_mask`` a tokenizer pads them with, as a ``.safetensors`` file. Two ways to cut
the text into rows:

* ``lines`` (default): each non-empty line a row, truncated to ``max_length`` tokens, the rows
  padded to the longest with the mask saying which positions are tokens (the reader cuts the
  padding off again, so no statistic counts it);
* ``blocks``: the whole text tokenised as one stream and cut into rows of exactly
  ``max_length`` tokens (what language-model training reads), the last partial block dropped.

The tokenizer directory is a closed world: its files are read only when they lie inside it
(links followed only within it), copied to a private directory and loaded from there, a
tokenizer that asks for its own code (``auto_map``) or names a file by a path is refused, and
nothing is downloaded.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile

import torch

from ..core.files import check_input_file, copy_regular, identity, model_file, remove_own
from ..core.schema import quoted
from ..errors import InputError
from .outdir import TMP_PREFIX, TOKENIZER_FILES, check_new_file

__all__ = ["load_tokenizer", "tokenize", "write_data_file", "MODES"]

MODES = ("lines", "blocks")
#: Bytes of text read at most (a data file for statistics is thousands of rows, not a corpus).
MAX_TEXT_BYTES = 1 << 30


def load_tokenizer(directory: str):
    """The tokenizer saved in ``directory``, loaded from copies of its files (each a regular file
    inside the directory), without running or downloading anything."""
    if not os.path.isdir(os.path.expanduser(str(directory))):
        raise InputError(f"--tokenizer {directory!r} is not a directory; expected a directory holding a "
                         "tokenizer as save_pretrained writes it (tokenizer.json, tokenizer_config.json, ...)")
    directory = os.path.expanduser(str(directory))
    present = [fn for fn in TOKENIZER_FILES if os.path.lexists(os.path.join(directory, fn))]
    if not present:
        raise InputError(f"--tokenizer {directory!r} holds none of {', '.join(TOKENIZER_FILES[:4])}, ...; "
                         "expected a directory a tokenizer was saved into")
    with tempfile.TemporaryDirectory(prefix="symgraph-tokenizer-") as tmp:
        for fn in present:
            copy_regular(model_file(directory, fn, what="tokenizer file"), os.path.join(tmp, fn))
        _check_config(os.path.join(tmp, "tokenizer_config.json"), directory)
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"--tokenizer {directory!r} cannot be loaded ({type(e).__name__}: "
                             f"{quoted(e, 160)}); expected a tokenizer saved by save_pretrained") from None
    if tok.pad_token is None:  # LLaMA-style tokenizers have none: pad with the end token, as is usual
        if tok.eos_token is None:
            raise InputError(f"the tokenizer in {directory!r} has neither a padding nor an end token; expected a "
                             "tokenizer with a pad_token or eos_token to pad rows with")
        tok.pad_token = tok.eos_token
    return tok


def _check_config(path: str, directory: str) -> None:
    """Refuse a tokenizer config that asks for the directory's own code or names a file by a path."""
    if not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"tokenizer_config.json in {directory!r} is not JSON ({type(e).__name__}); expected the "
                         "file save_pretrained writes") from None
    if not isinstance(cfg, dict):
        raise InputError(f"tokenizer_config.json in {directory!r} is not a JSON object; expected the file "
                         "save_pretrained writes")
    if cfg.get("auto_map"):
        raise InputError(f"the tokenizer in {directory!r} asks for its own code (auto_map); symgraph never runs "
                         "code from a model directory; expected a tokenizer transformers ships")
    for k, v in cfg.items():
        if k.endswith("_file") and isinstance(v, str) and (os.path.isabs(v) or os.sep in v or "/" in v):
            raise InputError(f"tokenizer_config.json in {directory!r} names {k} {v!r}, a path; expected the "
                             "tokenizer's own files, inside its directory")


def tokenize(texts, tok, max_length: int, mode: str = "lines") -> dict:
    """``{"input_ids", "attention_mask"}`` (int64 ``[N, S]``) of ``texts`` (strings) by ``tok``."""
    if mode not in MODES:
        raise InputError(f"--mode {mode!r}; expected one of {MODES}")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or not 2 <= max_length <= 1 << 20:
        raise InputError(f"--max-length {max_length!r}; expected a number of tokens from 2 to {1 << 20}")
    if mode == "lines":
        rows = [line.strip() for t in texts for line in t.splitlines() if line.strip()]
        if not rows:
            raise InputError("the text holds no non-empty line; expected text to tokenise")
        b = tok(rows, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        return {"input_ids": b["input_ids"].long(), "attention_mask": b["attention_mask"].long()}
    ids = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]]
    n = len(ids) // max_length
    if n == 0:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one block of --max-length {max_length}; "
                         "expected more text or a smaller --max-length")
    x = torch.tensor(ids[: n * max_length], dtype=torch.long).reshape(n, max_length)
    return {"input_ids": x, "attention_mask": torch.ones_like(x)}


def read_texts(paths) -> list:
    """The UTF-8 text of each file of ``paths``, refused in one line when one is missing, not a
    regular file, not UTF-8 or larger than :data:`MAX_TEXT_BYTES`."""
    texts = []
    for p in paths:
        check_input_file(p, "text file", "a UTF-8 text file")
        if os.path.getsize(p) > MAX_TEXT_BYTES:
            raise InputError(f"text file {p!r} is larger than {MAX_TEXT_BYTES >> 20} MB; expected a sample of text "
                             "for statistics (a few thousand rows)")
        try:
            with open(p, encoding="utf-8") as f:
                texts.append(f.read())
        except UnicodeDecodeError as e:
            raise InputError(f"text file {p!r} is not UTF-8 (byte {e.start}); expected UTF-8 text") from None
    return texts


def write_data_file(texts, tokenizer: str, out: str, *, max_length: int = 128, mode: str = "lines",
                    inputs=()) -> dict:
    """Tokenise ``texts`` (strings) with the tokenizer in ``tokenizer`` and write the data file
    ``out`` (a new ``.safetensors`` file, written whole or not at all); returns its summary."""
    from safetensors.torch import save_file
    if not str(out).endswith(".safetensors"):
        raise InputError(f"--out {out!r}; expected a new file name ending in .safetensors")
    real = check_new_file(out, "--out", inputs=[tokenizer, *inputs])
    data = tokenize(texts, load_tokenizer(tokenizer), max_length, mode)
    tmp: str | None
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".safetensors", dir=os.path.dirname(real))
    os.close(fd)
    made = identity(tmp)
    try:
        save_file({k: v.contiguous() for k, v in data.items()}, tmp)
        made = identity(tmp)  # the file save_file wrote (it may have replaced the one made above)
        try:
            os.link(tmp, real)  # fails rather than replace a file that appeared meanwhile
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV) or os.path.lexists(real):
                raise InputError(f"--out {out!r} could not be written ({e.strerror}); expected a new file name") from None
            os.replace(tmp, real)
            tmp = None
    finally:
        if tmp is not None:
            remove_own(tmp, made, TMP_PREFIX)  # only the file made here, whatever the name holds now
    ids, mask = data["input_ids"], data["attention_mask"]
    return {"out": real, "rows": int(ids.shape[0]), "length": int(ids.shape[1]), "tokens": int(mask.sum()),
            "padding": int(mask.numel() - mask.sum())}


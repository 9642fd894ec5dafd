"""``symgraph data TEXT... --tokenizer DIR --out FILE``: the data file a tokenizer makes of text,
padding masked, read back by every step as the same rows unpadded; refusals in one line, the
tokenizer directory a closed world, nothing written but ``--out``."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import digest, main_in_process, refused

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "", "the bird sang a long song",
         "rain fell on the old town all night", "she read the letter twice", "we walked home"]


def _tokenizer(path):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(tm.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]")
    tok.save_pretrained(path)
    return tok


@pytest.fixture()
def ws(tmp_path):
    (tmp_path / "work").mkdir()
    tok = _tokenizer(tmp_path / "tok")
    (tmp_path / "work" / "a.txt").write_text("\n".join(TEXTS[:4]) + "\n")
    (tmp_path / "work" / "b.txt").write_text("\n".join(TEXTS[4:]) + "\n")
    return tmp_path, tok


def test_lines_are_rows_padded_and_masked_as_the_tokenizer_pads_them(ws, capsys):
    root, tok = ws
    before = digest(root / "tok")
    r = main_in_process(root, "data", "a.txt", "b.txt", "--tokenizer", root / "tok", "--out", "d.safetensors",
                        capsys=capsys)
    assert r.returncode == 0, r.stderr
    got = load_file(str(root / "work" / "d.safetensors"))
    want = tok([t for t in TEXTS if t], padding=True, truncation=True, max_length=128, return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["attention_mask"], want["attention_mask"])
    assert got["input_ids"].shape[0] == 6 and int(got["attention_mask"].sum()) < got["input_ids"].numel()
    assert sorted(os.listdir(root / "work")) == ["a.txt", "b.txt", "d.safetensors"]  # no temporary left
    assert digest(root / "tok") == before
    # read back as the rows unpadded: every batch's rows of one length, no padding token left
    from symgraph.checkpoints.specs import load_data
    batches = load_data(str(root / "work" / "d.safetensors"))
    rows = sorted(tuple(x.tolist()) for b in batches for x in b["input_ids"])
    pad = tok.pad_token_id
    assert all(pad not in row for row in rows) and len(rows) == 6
    assert sum(len(r) for r in rows) == int(got["attention_mask"].sum())


def test_blocks_cut_the_stream_into_full_rows(ws, capsys):
    root, tok = ws
    r = main_in_process(root, "data", "a.txt", "b.txt", "--tokenizer", root / "tok", "--out", "d.safetensors",
                        "--mode", "blocks", "--max-length", "4", capsys=capsys)
    assert r.returncode == 0, r.stderr
    got = load_file(str(root / "work" / "d.safetensors"))
    stream = [i for t in ("\n".join(TEXTS[:4]) + "\n", "\n".join(TEXTS[4:]) + "\n")
              for i in tok(t, add_special_tokens=False)["input_ids"]]
    n = len(stream) // 4
    assert got["input_ids"].tolist() == torch.tensor(stream[: 4 * n]).reshape(n, 4).tolist()
    assert bool(got["attention_mask"].all())


@pytest.mark.parametrize("case, needles", [
    ("missing_text", ["text file", "nope.txt"]),
    ("no_tokenizer", ["--tokenizer", "not a directory"]),
    ("exists", ["already exists"]),
    ("suffix", ["expected a new file name ending in .safetensors"]),
    ("auto_map", ["asks for its own code"]),
    ("path_in_config", ["a path; expected the tokenizer's own files"]),
    ("link_out", ["points outside the model directory"]),
    ("length", ["--max-length 1; expected a number of tokens"]),
    ("empty", ["no non-empty line"]),
])
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(ws, capsys, case, needles):
    root, _ = ws
    args = ["a.txt", "--tokenizer", str(root / "tok"), "--out", "d.safetensors"]
    cfg = root / "tok" / "tokenizer_config.json"
    if case == "missing_text":
        args[0] = "nope.txt"
    elif case == "no_tokenizer":
        args[2] = str(root / "none")
    elif case == "exists":
        (root / "work" / "d.safetensors").write_bytes(b"mine")
    elif case == "suffix":
        args[4] = "d.pt"
    elif case in ("auto_map", "path_in_config"):
        c = json.loads(cfg.read_text())
        c.update({"auto_map": {"AutoTokenizer": ["x.Tok", None]}} if case == "auto_map" else
                 {"tokenizer_file": str(root / "secret.json")})
        cfg.write_text(json.dumps(c))
    elif case == "link_out":
        (root / "secret.json").write_text((root / "tok" / "tokenizer.json").read_text())
        os.unlink(root / "tok" / "tokenizer.json")
        os.symlink(root / "secret.json", root / "tok" / "tokenizer.json")
    elif case == "length":
        args += ["--max-length", "1"]
    elif case == "empty":
        (root / "work" / "a.txt").write_text("\n  \n")
    before = digest(root / "work")
    r = main_in_process(root, "data", *args, capsys=capsys)
    refused(r, *needles)
    assert digest(root / "work") == before

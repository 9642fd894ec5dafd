"""A data file of token rows drives every data step of an encoder-decoder model from the command
line: the decoder reads each row shifted right behind its start token (teacher forcing), so
activation matching, Fisher, RegMean with REPAIR and learned matching run out of core; a Python
batch whose decoder ids input_ids cannot label is refused naming the labels it needs."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors.torch import save_file

import symgraph
from symgraph.checkpoints.specs import load_data
from symgraph.errors import InputError

from conftest import cli

CFG = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
           decoder_start_token_id=0)


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    for s in (0, 1):
        torch.manual_seed(s)
        T.T5ForConditionalGeneration(T.T5Config(**CFG)).save_pretrained(root / f"t5_{s}")
    ids = torch.randint(2, 64, (16, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:4, 7:] = 0  # right padding on four rows
    save_file({"input_ids": ids, "attention_mask": mask}, str(root / "ids.safetensors"))
    return root


def test_the_decoder_reads_the_rows_shifted_right(t5):
    model = T.T5ForConditionalGeneration(T.T5Config(**CFG))
    batches = load_data(str(t5 / "ids.safetensors"), model)
    assert sum(b["input_ids"].shape[0] for b in batches) == 16
    for b in batches:
        ids, dec = b["input_ids"], b["decoder_input_ids"]
        assert dec.shape == ids.shape and (dec[:, 0] == 0).all() and torch.equal(dec[:, 1:], ids[:, :-1])


@pytest.mark.parametrize("flags", [["--align", "activations"], ["--method", "fisher"]])
def test_data_merges_of_an_encoder_decoder_run_out_of_core(t5, tmp_path, flags):
    r = cli("merge", t5 / "t5_0", t5 / "t5_1", *flags, "--data", t5 / "ids.safetensors", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-1500:]
    rec = json.loads((tmp_path / "o" / "symgraph_merge.json").read_text())
    assert rec["mode"] == "streaming"


def test_refine_asks_for_labels_it_cannot_derive():
    torch.manual_seed(0)
    a, b = (T.T5ForConditionalGeneration(T.T5Config(**CFG)).eval() for _ in range(2))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 64, (4, 8), generator=g),
             "decoder_input_ids": torch.randint(2, 64, (4, 6), generator=g)}]
    with pytest.raises(InputError, match="expected 'labels' \\(the decoder's target ids\\) in each batch"):
        symgraph.merge([a, b], data=data, refine=2)

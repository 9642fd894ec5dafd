"""An ``attention_mask`` in a data file is honoured wherever data is read (issue 62): the padding
is cut off where the batches are read (:func:`symgraph.checkpoints.specs.unpadded`), so
activation statistics, RegMean's Grams, REPAIR, the barrier's loss and compare see the tokens
alone. A merge from padded rows with their mask equals the merge from the same rows unpadded;
without the mask (padding counted) it differs. A bad mask is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from symgraph.checkpoints.specs import BATCH_ROWS, load_data, unpadded
from symgraph.testing import models

from cli_helpers import main_in_process

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
N, S, PAD = 32, 12, 5  # rows, tokens per row, padding added


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("mask")
    (root / "work").mkdir()
    models.build("llama", seed=0, **L).save_pretrained(root / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "b")
    ids = torch.randint(1, 64, (N, S), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(N, PAD, dtype=torch.long)
    ones, zeros = torch.ones(N, S, dtype=torch.long), torch.zeros(N, PAD, dtype=torch.long)
    left = torch.arange(N) % 2 == 1  # odd rows padded on the left, even rows on the right
    padded = torch.where(left[:, None], torch.cat([pad, ids], 1), torch.cat([ids, pad], 1))
    mask = torch.where(left[:, None], torch.cat([zeros, ones], 1), torch.cat([ones, zeros], 1))
    save_file({"input_ids": ids}, str(root / "plain.safetensors"))
    save_file({"input_ids": padded, "attention_mask": mask}, str(root / "masked.safetensors"))
    save_file({"input_ids": padded}, str(root / "unmasked.safetensors"))
    holes = mask.clone()
    holes[3, 8] = 0
    save_file({"input_ids": padded, "attention_mask": holes}, str(root / "holes.safetensors"))
    save_file({"input_ids": padded, "attention_mask": mask[:, :-1].contiguous()}, str(root / "short.safetensors"))
    return root


def merged(ws, capsys, name, data, *flags):
    r = main_in_process(ws, "merge", "../a", "../b", "--data", f"../{data}.safetensors", *flags, "--out", name,
                        capsys=capsys, seconds=300)
    assert r.returncode == 0, r.stderr
    out = ws / "work" / name
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors, json.loads((out / "symgraph_merge.json").read_text())


def max_diff(x, y):
    assert x.keys() == y.keys()
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def test_the_mask_cuts_the_padding_where_batches_are_read(ws):
    plain = load_data(str(ws / "plain.safetensors"))
    masked = load_data(str(ws / "masked.safetensors"))
    assert len(plain) == len(masked) == -(-N // BATCH_ROWS)
    for p, m in zip(plain, masked):
        assert torch.equal(p["input_ids"], m["input_ids"])
    ids = torch.tensor([[5, 6, 7, 0], [0, 0, 8, 9], [1, 2, 3, 4]])
    got = unpadded(ids, torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]]))
    assert [b["input_ids"].tolist() for b in got] == [[[1, 2, 3, 4]], [[5, 6, 7]], [[8, 9]]]


@pytest.mark.parametrize("flags", [("--align", "activations"), ("--method", "regmean", "--repair")])
@pytest.mark.slow
def test_padded_rows_with_their_mask_merge_as_the_rows_unpadded(ws, capsys, flags):
    tag = "_".join(f.strip("-") for f in flags)
    plain, rec_plain = merged(ws, capsys, f"plain_{tag}", "plain", *flags)
    masked, rec_masked = merged(ws, capsys, f"masked_{tag}", "masked", *flags)
    unmasked, _ = merged(ws, capsys, f"unmasked_{tag}", "unmasked", *flags)
    assert max_diff(plain, masked) <= 1e-6
    assert max_diff(plain, unmasked) > 1e-3  # padding counted: another merge
    assert rec_plain["options"]["data_batches"] == rec_masked["options"]["data_batches"]


def test_barrier_loss_ignores_the_padding(ws, capsys):
    rows = {}
    for data in ("plain", "masked", "unmasked"):
        r = main_in_process(ws, "barrier", "../a", "../b", "--data", f"../{data}.safetensors", "--align", "none",
                            "--points", "3", "--out", f"barrier_{data}", capsys=capsys, seconds=300)
        assert r.returncode == 0, r.stderr
        rows[data] = json.loads((ws / "work" / f"barrier_{data}" / "barrier.json").read_text())["rows"]
    flat = {k: json.dumps([{f: x for f, x in row.items() if f != "seconds"} for row in v], sort_keys=True)
            for k, v in rows.items()}
    assert flat["plain"] == flat["masked"] and flat["plain"] != flat["unmasked"]


@pytest.mark.parametrize("data, needles", [("holes", ["row 3", "not one run of ones"]),
                                           ("short", ["'attention_mask'", "expected (32, 17)"])])
def test_a_bad_mask_is_refused_in_one_line(ws, capsys, data, needles):
    r = main_in_process(ws, "merge", "../a", "../b", "--align", "activations", "--data", f"../{data}.safetensors",
                        "--out", "bad", capsys=capsys)
    assert r.returncode == 2 and r.stderr.count("symgraph:") == 1, r.stderr
    flat = " ".join(r.stderr.split())
    for n in needles:
        assert n in flat, (n, flat)
    assert not (ws / "work" / "bad").exists()

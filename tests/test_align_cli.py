"""Align once, merge anywhere: ``symgraph align A B --out DIR`` writes B in A's basis (B's config,
dtype and sharding) with its alignment; ``symgraph apply`` carries a fine-tune of B with the
saved alignment, exactly as the alignment applied in memory; refusals are one paragraph."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.cli.main import main
from symgraph.testing.models import build, train

from conftest import checkpoint_tensors, successor_sampler

V = 64


def _loss(model, data) -> float:
    with torch.no_grad():
        return sum(float(model(**b).loss) for b in data) / len(data)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two trained tiny LLaMAs in bf16: A in one file, B in shards."""
    d = tmp_path_factory.mktemp("pair")
    a, b = build("llama", seed=1, vocab=V), build("llama", seed=2, vocab=V)
    train(a, successor_sampler(1), steps=150, lr=3e-3, threads=1)
    train(b, successor_sampler(2), steps=150, lr=3e-3, threads=1)
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    a.save_pretrained(d / "a")
    b.save_pretrained(d / "b", max_shard_size="20KB")
    s = successor_sampler(99)
    return d, a, b, [s() for _ in range(4)]


def test_align_writes_b_in_a_basis_sharded_like_b(pair, capsys):
    d, A, B, data = pair
    out = d / "b_in_a"
    assert main(["align", str(d / "a"), str(d / "b"), "--out", str(out)]) == 0
    shards_b = sorted(f for f in os.listdir(d / "b") if f.endswith(".safetensors"))
    assert len(shards_b) > 1
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors") and f.startswith("model")) == shards_b
    idx_b = json.loads((d / "b" / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == idx_b
    got = checkpoint_tensors(out)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in checkpoint_tensors(d / "b").items()}
    # the written tensors are the saved alignment applied in memory, bit for bit
    al = symgraph.load_alignment(out)
    want = al.apply(B).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)
    # B's function (up to bf16 rounding of the rotated weights), in A's basis: closer to A
    Bal = tf.AutoModelForCausalLM.from_pretrained(out)
    assert Bal.dtype == torch.bfloat16
    assert (out / "config.json").read_text() == (d / "b" / "config.json").read_text()  # B's config
    x = data[0]["input_ids"]
    with torch.no_grad():
        lb, lbal = B(x).logits.float(), Bal(x).logits.float()
    assert float((lb - lbal).norm() / lb.norm()) < 3e-2
    dist = lambda m: sum(float((p.float() - q.float()).norm() ** 2) for p, q in  # noqa: E731
                         zip(A.parameters(), m.parameters()))
    assert dist(Bal) < 0.8 * dist(B)
    rec = json.loads((out / "symgraph_align.json").read_text())["symgraph_align"]
    assert rec["align"] == "weights" and rec["dtype"] == "bfloat16"


def test_a_fine_tune_of_b_is_carried_by_the_saved_alignment(pair):
    d, A, B, data = pair
    out = d / "b_in_a2"
    assert main(["align", str(d / "a"), str(d / "b"), "--out", str(out)]) == 0
    C = copy.deepcopy(B).float()
    train(C, successor_sampler(7), steps=20, lr=1e-3, threads=1)
    C = C.to(torch.bfloat16)
    C.save_pretrained(d / "c")
    assert main(["apply", str(out / "symgraph_alignment.safetensors"), str(d / "c"), "--out", str(d / "c_in_a")]) == 0
    got = checkpoint_tensors(d / "c_in_a")
    want = symgraph.load_alignment(out).apply(C).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)  # exact
    Cal = tf.AutoModelForCausalLM.from_pretrained(d / "c_in_a")
    aligned = _loss(symgraph.merge([A, Cal], align=None).model, data)
    plain = _loss(symgraph.merge([A, C], align=None).model, data)
    assert aligned < plain - 0.05, (aligned, plain)


def test_refusals_are_one_paragraph(pair, capsys):
    d, A, B, data = pair
    wide = build("llama", seed=3, vocab=V, hidden=64).to(torch.bfloat16)
    wide.save_pretrained(d / "wide")
    al_dir = d / "al"
    assert main(["align", str(d / "a"), str(d / "b"), "--out", str(al_dir)]) == 0
    capsys.readouterr()
    cases = [
        (["apply", str(al_dir), str(d / "wide"), "--out", str(d / "x1")], "another symmetry structure"),
        (["align", str(d / "a"), str(d / "wide"), "--out", str(d / "x2")], "one width"),
        (["apply", str(d / "a" / "config.json"), str(d / "b"), "--out", str(d / "x3")], "not a safetensors file"),
        (["apply", str(d / "nowhere"), str(d / "b"), "--out", str(d / "x4")], "does not exist"),
        (["align", str(d / "a"), str(d / "b"), "--out", str(d / "b" / "inside")], "inside"),
        (["align", str(d / "a"), str(d / "b"), "--out", str(d / "x5"), "--align", "activations"], "--data"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in " ".join(err.split()) and "Traceback" not in err, (argv, err)
        assert not os.path.exists(argv[argv.index("--out") + 1])

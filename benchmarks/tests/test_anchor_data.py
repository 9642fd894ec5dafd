"""Fast tests of the Theus et al. (2025) anchor protocol (benchmarks.anchor): data split,
sequence cutting, batching, errors, evaluation, and bit-exact resumable training of a tiny model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.anchor import data
from benchmarks.anchor import train as tr

# the GPT-2 tokenizer files: $ANCHOR_TOKENIZER, else .anchor-data/gpt2_tokenizer in the checkout
# (where benchmarks/anchor/device.sh reads them)
TOKENIZER = Path(os.environ.get("ANCHOR_TOKENIZER")
                 or Path(__file__).resolve().parents[2] / ".anchor-data" / "gpt2_tokenizer")
needs_tokenizer = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file(),
                                     reason=f"GPT-2 tokenizer files not in {TOKENIZER} (set ANCHOR_TOKENIZER)")

TINY = dict(n_embd=8, n_layer=1, n_head=2, n_inner=16)


def synthetic_text(n_lines: int = 120) -> str:
    g = torch.Generator().manual_seed(0)
    words = ["thou", "art", "the", "king", "of", "my", "heart", "and", "ROMEO:", "JULIET:",
             "what", "light", "through", "yonder", "window", "breaks", "love", ",", ".", "!"]
    lines = []
    for _ in range(n_lines):
        k = int(torch.randint(3, 12, (1,), generator=g))
        idx = torch.randint(0, len(words), (k,), generator=g).tolist()
        lines.append(" ".join(words[i] for i in idx))
    return "\n".join(lines) + "\n"


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(synthetic_text(), encoding="utf-8")
    return p


def test_split_text_contiguous_90_5_5():
    text = synthetic_text()
    n = len(text)
    tr_, va, te = data.split_text(text)
    assert tr_ + va + te == text
    assert len(te) == round(n * 0.05) and len(va) == round(n * 0.05)
    assert len(tr_) == n - len(va) - len(te)
    assert abs(len(tr_) / n - 0.9) < 1e-3


@needs_tokenizer
def test_load_splits_tokenizes_each_split_whole(corpus, tmp_path):
    text = corpus.read_text(encoding="utf-8")
    splits = data.load_splits(corpus, TOKENIZER, cache=tmp_path / "c")
    tok = data.load_tokenizer(TOKENIZER)
    for ids, part in zip((splits[k] for k in data.SPLITS), data.split_text(text)):
        assert ids.dtype == torch.long
        assert ids.tolist() == tok(part)["input_ids"]
    assert tok.decode(splits["train"].tolist()) + tok.decode(splits["validation"].tolist()) \
        + tok.decode(splits["test"].tolist()) == text
    # second call reads the cache and gives the same tensors
    assert len(list((tmp_path / "c").glob("tokens-*.pt"))) == 1
    again = data.load_splits(corpus, TOKENIZER, cache=tmp_path / "c")
    for k in data.SPLITS:
        assert torch.equal(again[k], splits[k])


def test_sequences_non_overlapping_256_drop_tail():
    ids = torch.arange(3 * 256 + 100)
    seqs = data.sequences(ids)
    assert seqs.shape == (3, 256)
    assert torch.equal(seqs.reshape(-1), ids[: 3 * 256])  # from token 0, contiguous, tail dropped
    assert data.sequences(torch.arange(255)).shape == (0, 256)


def test_batches_cover_the_split_each_epoch():
    seqs = data.sequences(torch.arange(10 * 256))
    assert data.steps_per_epoch(10, 4) == 3
    for epoch in (0, 1):
        got = list(data.batches(seqs, 4, seed=42, epoch=epoch))
        assert [b.shape[0] for b in got] == [4, 4, 2]  # last partial batch kept
        firsts = torch.cat([b[:, 0] for b in got]) // 256
        assert sorted(firsts.tolist()) == list(range(10))
        assert all(b.shape[1] == 256 for b in got)
    e0 = torch.cat(list(data.batches(seqs, 4, seed=42, epoch=0)))
    e1 = torch.cat(list(data.batches(seqs, 4, seed=42, epoch=1)))
    assert not torch.equal(e0, e1)
    tail = torch.cat(list(data.batches(seqs, 4, seed=42, epoch=0, start=1)))
    assert torch.equal(tail, e0[4:])
    assert torch.equal(torch.cat(list(data.batches(seqs, 4))), seqs)


def test_missing_paths_raise_one_line_error(tmp_path, corpus, capsys):
    with pytest.raises(data.AnchorError) as e:
        data.load_splits(tmp_path / "nope.txt", TOKENIZER, cache=False)
    assert "corpus" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(data.AnchorError) as e:
        data.load_splits(corpus, tmp_path / "no_tok", cache=False)
    assert "tokenizer" in str(e.value) and "\n" not in str(e.value)
    rc = tr.main(["--corpus", str(tmp_path / "nope.txt"), "--tokenizer", str(TOKENIZER),
                  "--seed", "0", "--cache", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: corpus file not found")


def test_config_is_the_protocol():
    c = data.config()
    assert (c.n_layer, c.n_head, c.n_embd, c.n_inner, c.n_positions) == (6, 4, 256, 1024, 256)
    assert c.tie_word_embeddings is False and c.activation_function == "gelu_new"
    assert (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) == (0.1, 0.1, 0.1)
    assert c.vocab_size == 50257


def test_test_loss_matches_hf_loss_in_eval_mode():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(data.config(vocab_size=97, block_size=16, **TINY)).train()
    seqs = torch.randint(0, 97, (5, 16))
    got = data.test_loss(model, seqs, batch_size=2, block_size=16)
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=seqs, labels=seqs).loss
    torch.testing.assert_close(torch.tensor(got), ref.float(), rtol=1e-5, atol=1e-5)


def _tiny_train(corpus, cache, **kw):
    args = dict(config_overrides=TINY, block_size=16, batch_size=2, eval_every=1000, threads=None,
                echo=lambda m: None)
    args.update(kw)
    return tr.train(corpus, TOKENIZER, 3, cache=cache, **args)


def _ckpt(cache):
    return torch.load(tr.checkpoint_path(cache, 3), map_location="cpu", weights_only=False)


@needs_tokenizer
def test_resume_gives_the_same_weights(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _tiny_train(corpus, a, max_steps=2)  # uninterrupted
    _tiny_train(corpus, b, max_steps=1)  # interrupted after step 1 ...
    assert _ckpt(b)["state"]["step"] == 1
    _tiny_train(corpus, b, max_steps=2)  # ... and resumed
    ca, cb = _ckpt(a), _ckpt(b)
    assert ca["state"]["step"] == cb["state"]["step"] == 2
    torch.testing.assert_close(cb["model"], ca["model"], rtol=0, atol=0)
    torch.testing.assert_close(cb["optimizer"]["state"], ca["optimizer"]["state"], rtol=0, atol=0)
    assert cb["scheduler"]["last_epoch"] == ca["scheduler"]["last_epoch"] == 2
    assert ca["log"]["train_loss"] == cb["log"]["train_loss"]
    # no temp files left behind by the atomic writes
    assert not any(f.name.endswith(".tmp" + str(os.getpid())) for f in b.iterdir())


@needs_tokenizer
def test_full_tiny_run_early_stops_keeps_best_and_returns_when_done(corpus, tmp_path):
    cache = tmp_path / "c"
    log = _tiny_train(corpus, cache, epochs=2, eval_every=3, patience=2, lr=0.0)
    assert log["done"]
    assert log["stop_reason"] == "early_stop"  # lr 0: the loss never strictly improves
    assert log["best_step"] == 3 and [e["best"] for e in log["evals"]] == [True, False, False]
    parent = tr.load_parent(cache, 3)
    splits = data.load_splits(corpus, TOKENIZER, cache=cache)
    assert log["final_test_loss"] == pytest.approx(
        data.test_loss(parent, splits["test"], block_size=16), rel=1e-6)
    again = _tiny_train(corpus, cache, epochs=2, eval_every=3, patience=2, lr=0.0)
    assert again == tr.read_log(cache, 3) and again["done"]


@needs_tokenizer
def test_a_schedule_of_steps_ends_there_done(corpus, tmp_path):
    """``schedule_steps`` (``--size small``): the cosine schedule over that many steps, training
    ends there done (stop reason ``schedule``), the learning rate at its end 0."""
    cache = tmp_path / "c"
    log = _tiny_train(corpus, cache, schedule_steps=3, eval_every=2)
    assert log["done"] and log["stop_reason"] == "schedule" and log["total_steps"] == 3
    assert len(log["train_loss"]) == 3 and log["protocol"]["schedule_steps"] == 3
    assert _ckpt(cache)["scheduler"]["_last_lr"] == [0.0, 0.0]
    assert tr.SIZES["small"]["train"]["schedule_steps"] > 0 and tr.SIZES["paper"] == {"config": {}, "train": {}}


@needs_tokenizer
def test_a_finished_parent_is_refused_in_another_precision_and_retrained_on_request(corpus, tmp_path):
    """A done parent asked for in bf16 is an error naming both precisions; ``retrain`` removes
    its checkpoint and model and trains it again from the start, to the same weights."""
    cache = tmp_path / "c"
    first = _tiny_train(corpus, cache, schedule_steps=3, eval_every=2)
    with pytest.raises(data.AnchorError, match="was trained in float32, not bf16"):
        _tiny_train(corpus, cache, schedule_steps=3, eval_every=2, bf16=True)
    said = []
    again = _tiny_train(corpus, cache, schedule_steps=3, eval_every=2, retrain=True, echo=said.append)
    assert not any("already trained" in m or "resumed" in m for m in said) and again["done"]
    assert again["train_loss"] == first["train_loss"] and len(again["runs"]) == 1
    assert not (cache / "parent-seed3.old").exists() and tr.read_log(cache, 3) == again


def test_learned_budget_batches_follow_the_data_order():
    """Learned matching's budget: ``max_steps`` batches of ``batch_size`` in the parents' data
    order, epoch after epoch; else ``epochs`` whole epochs."""
    from benchmarks.anchor import table
    seqs = torch.arange(10 * 4).reshape(10, 4)
    got = table.learn_batches(seqs, {"batch_size": 3, "max_steps": 5, "epochs": 10})
    want = [*data.batches(seqs, 3, seed=tr.DATA_SEED, epoch=0), *data.batches(seqs, 3, seed=tr.DATA_SEED, epoch=1)]
    assert len(got) == 5 and [b["input_ids"].shape[0] for b in got] == [3, 3, 3, 1, 3]
    for g, w in zip(got, want):
        assert torch.equal(g["input_ids"], w)
    assert len(table.learn_batches(seqs, {"batch_size": 3, "max_steps": None, "epochs": 2})) == 8
    assert table.LEARN["paper"] == {"epochs": 10, "batch_size": 32, "max_steps": None}  # their run_merger.sh


def test_folded_rows_run_on_the_parents_with_gains_folded():
    """``gains_folded``: LayerNorm gains 1, shifts 0 where the readers take them, the same function; a ``_folded`` row's
    curve ends at the parents' losses, and a function-preserving rescale of a norm's gain
    against its readers leaves it unchanged (the folded form does not see the split)."""
    from symgraph.core.ties import untie
    from symgraph.testing import models
    from benchmarks.anchor import table
    A, B = (untie(models.build("gpt2", seed=s, vocab=64, hidden=32, layers=1, heads=4, positions=64))
            for s in (0, 1))
    for m in (A, B):
        models.randomize_vectors(m, seed=7)
    test = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    Af = table.gains_folded(A)
    norms = [x for x in Af.modules() if isinstance(x, torch.nn.LayerNorm)]
    assert norms and all(torch.equal(x.weight, torch.ones_like(x.weight)) for x in norms)
    assert torch.equal(Af.transformer.h[0].ln_1.bias, torch.zeros(32))  # (ln_f's stays: the head has no bias)
    assert table.D.test_loss(Af, test) == pytest.approx(table.D.test_loss(A, test), abs=1e-5)
    r = table.run_row("weights_perm_folded", A, B, train=[{"input_ids": test}], test=test, refine_steps=0,
                      circuits=False)
    assert dict(r["curve"])[1.0] == pytest.approx(table.D.test_loss(A, test), abs=1e-5)
    Bf = dict(table.gains_folded(B).named_parameters())
    with torch.no_grad():  # gain × s, its reader's input rows / s: the same function, another split
        s = torch.linspace(0.5, 2.0, 32)
        blk = B.transformer.h[0]
        blk.ln_1.weight.mul_(s), blk.ln_1.bias.mul_(s), blk.attn.c_attn.weight.div_(s[:, None])
    assert not torch.allclose(B.transformer.h[0].attn.c_attn.weight, Bf["transformer.h.0.attn.c_attn.weight"])
    for k, p in table.gains_folded(B).named_parameters():  # the folded form does not see the split
        torch.testing.assert_close(p, Bf[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_table_rows_on_tiny_untied_gpt2():
    """The table's rows on two tiny untied GPT-2s: barriers from an 11-point curve whose ends
    are the parents' losses; circuit-space rows (GPT-2 widened in memory, learned matching in
    that space) whose ends are the parents' losses too."""
    import symgraph
    from symgraph.core.ties import untie
    from symgraph.testing import models
    from benchmarks.anchor import table
    A, B = (untie(models.build("gpt2", seed=s, vocab=64, hidden=32, layers=1, heads=4, positions=64))
            for s in (0, 1))
    g = torch.Generator().manual_seed(0)
    test = torch.randint(0, 64, (4, 32), generator=g)
    train = [{"input_ids": torch.randint(0, 64, (4, 32), generator=g)} for _ in range(2)]
    learn = [{"input_ids": torch.randint(0, 64, (2, 32), generator=g)} for _ in range(3)]
    rows = [table.run_row(n, A, B, train=train, test=test, refine_steps=2, circuits=False, learn=learn,
                          seen=train[0]["input_ids"][:, :3])  # a few of the 64 tokens
            for n in ("vanilla", "weights", "learned", "weights_seen", "weights_cols", "weights_circ")]
    assert rows[2]["options"]["data_batches"] == {"batches": 3, "shape": [2, 32]}  # the learned budget's batches
    for r in rows:
        assert [lam for lam, _ in r["curve"]] == pytest.approx(list(table.LAMBDAS))
        ends = dict(r["curve"])
        assert ends[1.0] == pytest.approx(table.D.test_loss(A, test), abs=1e-5)
        assert r["barrier"] == pytest.approx(symgraph.loss_barrier(r["curve"]))
    assert rows[2]["refine_steps"] == 2
    assert rows[3]["curve"][5] != rows[1]["curve"][5]  # the seen rows change the alignment
    cs = [table.run_row(n, A, B, train=train, test=test, refine_steps=2, circuits=True)
          for n in ("weights", "learned")]
    for c, r in zip(cs, rows[1:3]):
        ends = dict(c["curve"])
        assert ends[1.0] == pytest.approx(table.D.test_loss(A, test), abs=1e-5) and c["note"] is None
        assert c["space"] == "circuits" and c["barrier"] == pytest.approx(symgraph.loss_barrier(c["curve"]))
    assert dict(cs[0]["curve"])[0.0] == pytest.approx(dict(rows[1]["curve"])[0.0], abs=1e-5)  # same aligned B
    md = table.markdown({"rows": rows + cs, "parent_test_loss": [5.3, 5.3], "protocol_note": "x",
                         "command": "python -m benchmarks.anchor"})
    assert "| weights | 0.34 |" in md and f"{cs[0]['barrier']:.3f}" in md

"""Fast tests of the benchmark data / zoo / training / evaluation layer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks import data, evaluate, train, zoo

ALL_SPECS = sorted(zoo.SPECS)


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("corpus", data.TEXT_CORPORA)
def test_tokenizer_round_trip_and_specials(corpus):
    tok = data.get_tokenizer(corpus)
    assert tok.get_vocab_size() == data.VOCAB_SIZE
    assert tok.token_to_id("[PAD]") == data.PAD_ID == 0
    assert tok.token_to_id("[MASK]") == data.MASK_ID == 1
    snippet = data.split_text("prose", "eval")[:400] + "  déjà vu \t日本語\n"
    ids = tok.encode(snippet).ids
    assert tok.decode(ids) == snippet
    assert all(0 <= i < data.VOCAB_SIZE for i in ids)
    # BPE actually compresses the corpus it was trained on.
    sample = data.split_text(corpus, "eval")[:5000]
    assert len(tok.encode(sample).ids) < 0.6 * len(sample.encode("utf-8"))


def test_tokenizer_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAPH_CACHE", str(tmp_path))
    data.get_tokenizer.cache_clear()
    try:
        tok = data.get_tokenizer("prose")
        files = list((tmp_path / "tokenizers").glob("prose-bpe*.json"))
        assert len(files) == 1
        data.get_tokenizer.cache_clear()
        assert data.get_tokenizer("prose").to_str() == tok.to_str()  # loaded == trained
    finally:
        data.get_tokenizer.cache_clear()


@pytest.mark.parametrize("corpus", data.TEXT_CORPORA)
def test_text_split_disjoint_and_complete(corpus):
    full = data.corpus_text(corpus)
    train_text, eval_text = data.split_text(corpus, "train"), data.split_text(corpus, "eval")
    assert train_text + eval_text == full
    assert train_text.endswith("\n")
    assert abs(len(eval_text) / len(full) - data.EVAL_FRACTION) < 0.01
    n_train, n_eval = len(data.token_ids(corpus, "train")), len(data.token_ids(corpus, "eval"))
    assert n_eval > 10_000 and 0.05 < n_eval / (n_train + n_eval) < 0.15


def test_token_blocks_shape_and_content():
    ids = data.token_ids("code", "eval")
    blocks = data.token_blocks("code", "eval", 64)
    assert blocks.dtype == torch.long and blocks.shape == (len(ids) // 64, 64)
    assert torch.equal(blocks.reshape(-1), ids[: blocks.numel()])
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = data.random_blocks("code", "train", 64, 8, gen_a)
    assert torch.equal(a, data.random_blocks("code", "train", 64, 8, gen_b))
    assert a.shape == (8, 64) and a.dtype == torch.long


def test_mlm_mask_statistics_and_determinism():
    blocks = data.token_blocks("prose", "train", 64)
    masked, labels = data.mlm_mask(blocks, seed=0)
    selected = labels != -100
    rate = selected.float().mean().item()
    assert abs(rate - 0.15) < 0.005
    assert torch.equal(labels[selected], blocks[selected])  # labels hold originals
    assert (labels[~selected] == -100).all()
    assert torch.equal(masked[~selected], blocks[~selected])  # unselected untouched
    n = selected.sum().item()
    frac_mask = (masked[selected] == data.MASK_ID).sum().item() / n
    frac_kept = (masked[selected] == blocks[selected]).sum().item() / n
    assert abs(frac_mask - 0.8) < 0.01
    assert abs(frac_kept - 0.1) < 0.01  # (+ rare random draws equal to the original)
    assert (masked >= 0).all() and (masked < data.VOCAB_SIZE).all()
    again, again_labels = data.mlm_mask(blocks, seed=0)
    assert torch.equal(again, masked) and torch.equal(again_labels, labels)
    other, _ = data.mlm_mask(blocks, seed=1)
    assert not torch.equal(other, masked)


def test_mlm_mask_never_selects_special_tokens():
    ids = torch.tensor([[data.PAD_ID] * 50 + [data.MASK_ID] * 50])
    _, labels = data.mlm_mask(ids, seed=0, mlm_probability=1.0)
    assert (labels == -100).all()
    with pytest.raises(ValueError):
        data.mlm_mask(ids)


def test_digits_shapes_labels_and_split():
    from sklearn.datasets import load_digits

    x_tr, y_tr = data.digits("train")
    x_ev, y_ev = data.digits("eval")
    assert x_tr.shape == (1617, 1, 8, 8) and x_ev.shape == (180, 1, 8, 8)
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.long
    assert x_tr.min() == -1.0 and x_tr.max() == 1.0
    assert set(y_ev.tolist()) == set(range(10)) and set(y_tr.tolist()) == set(range(10))
    # train + eval is exactly the data set (as a multiset of (image, label) rows).
    raw = load_digits()
    raw_rows = np.hstack([raw.data / 16.0 * 2 - 1, raw.target[:, None]]).astype(np.float32)
    rows = torch.cat([torch.cat([x_tr, x_ev]).reshape(-1, 64), torch.cat([y_tr, y_ev])[:, None].float()], 1)
    got = np.unique(rows.numpy(), axis=0, return_counts=True)
    want = np.unique(raw_rows, axis=0, return_counts=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


# ---------------------------------------------------------------------------
# zoo and evaluation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL_SPECS)
def test_zoo_model_builds_and_has_finite_initial_loss(arch):
    model = zoo.build_model(arch, seed=0)
    assert not model.training
    assert model.config._attn_implementation == zoo.ATTN_IMPLEMENTATION
    batch = evaluate.eval_batches(arch, max_batches=1)[0]
    loss = evaluate.batch_loss(model, arch, batch).item()
    n_out = 10 if arch == "vit" else data.VOCAB_SIZE
    assert math.isfinite(loss)
    assert abs(loss - math.log(n_out)) < 1.0  # near-uniform predictions at init
    same = zoo.build_model(arch, seed=0)
    other = zoo.build_model(arch, seed=1)
    sd, sd_same, sd_other = model.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_same[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd_other[k]) for k in sd)


def test_zoo_architecture_details():
    llama = zoo.make_config("llama")
    assert llama.num_key_value_heads < llama.num_attention_heads  # GQA
    assert llama.hidden_act == "silu" and llama.use_cache is False
    assert zoo.make_config("gpt2").use_cache is False
    narrow, wide = (zoo.make_config(a) for a in zoo.WIDE_NARROW_PAIR)
    assert wide.n_inner == 2 * narrow.n_inner and wide.n_embd == narrow.n_embd
    for arch in ALL_SPECS:
        cfg = zoo.make_config(arch)
        drop = [v for k, v in cfg.to_dict().items() if ("drop" in k) and isinstance(v, float)]
        assert drop and all(v == 0.0 for v in drop), arch
        full = zoo.get_setting(arch, "full")
        quick = zoo.get_setting(arch, "quick")
        assert full.hidden > quick.hidden and full.steps > quick.steps
    with pytest.raises(ValueError):
        zoo.get_spec("nope")


@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_example_inputs_trace_shapes(arch):
    model = zoo.build_model(arch, seed=0)
    inputs = evaluate.example_inputs(arch)
    assert len(inputs) == 1 and inputs[0].shape[0] == 2
    kwargs = {"use_cache": False} if zoo.get_spec(arch).task == "clm" else {}
    with torch.no_grad():
        logits = model(*inputs, **kwargs).logits
    if arch == "vit":
        assert inputs[0].shape == (2, 1, 8, 8) and logits.shape == (2, 10)
    else:
        assert inputs[0].dtype == torch.long and inputs[0].shape == (2, 64)
        assert logits.shape == (2, 64, data.VOCAB_SIZE)


@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_eval_loss_metric_and_loss_fn_agree(arch):
    model = zoo.build_model(arch, seed=0)
    loss = evaluate.eval_loss(model, arch, max_batches=2)
    fn = evaluate.loss_fn_for(arch, max_batches=2)
    assert fn(model) == pytest.approx(loss, rel=1e-6)
    metric = evaluate.eval_metric(model, arch, max_batches=2)
    if arch == "vit":
        assert evaluate.metric_name(arch) == "accuracy" and 0.0 <= metric <= 1.0
    else:
        assert evaluate.metric_name(arch) == "perplexity"
        assert metric == pytest.approx(math.exp(loss), rel=1e-6)
    # A random init is no better than predicting the unigram / class prior.
    assert loss > evaluate.baseline_loss(arch) - 0.05


# ---------------------------------------------------------------------------
# training and cache
# ---------------------------------------------------------------------------


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow  # trains (3 steps) and reloads: ~15 s per arch
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_cache_round_trip(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("SYMGRAPH_CACHE", str(tmp_path))
    assert not train.is_cached(arch, 0, steps=3)
    trained = train.train_model(arch, 0, steps=3)
    path = train.checkpoint_dir(arch, 0, steps=3)
    assert path.parent.parent == tmp_path and train.is_cached(arch, 0, steps=3)
    assert (path / "model.safetensors").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    info = train.training_info(arch, 0, steps=3)
    assert info["steps"] == 3 and info["seed"] == 0 and math.isfinite(info["eval_loss"])
    assert not _state_equal(trained, zoo.build_model(arch, 0))  # training changed weights

    def no_training(*args, **kwargs):
        raise AssertionError("second call must load from the cache")

    monkeypatch.setattr(train, "_fit", no_training)
    loaded = train.train_model(arch, 0, steps=3)
    assert _state_equal(trained, loaded)
    assert evaluate.eval_loss(loaded, arch) == pytest.approx(info["eval_loss"], abs=1e-6)
    assert not train.is_cached(arch, 1, steps=3) and not train.is_cached(arch, 0, steps=4)


@pytest.mark.slow  # trains three models: ~10 s
def test_training_is_deterministic_and_seed_dependent():
    a = train.train_model("llama", 5, steps=2, use_cache=False)
    b = train.train_model("llama", 5, steps=2, use_cache=False)
    c = train.train_model("llama", 6, steps=2, use_cache=False)
    assert _state_equal(a, b)
    assert not _state_equal(a, c)


@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_medium_size_is_the_published_alignment_size(arch):
    """``medium``: 6 layers, width 256, 4 heads, MLP 1024 (Theus et al.'s range), its own cache key."""
    from benchmarks import train
    s = zoo.get_setting(arch, "medium")
    assert (s.layers, s.hidden, s.heads, s.mlp_width) == (6, 256, 4, 1024)
    cfg = zoo.make_config(arch, "medium")
    assert cfg.num_hidden_layers == 6 and cfg.hidden_size == 256 and cfg.num_attention_heads == 4
    assert train.checkpoint_dir(arch, 0, "medium") != train.checkpoint_dir(arch, 0, "quick")
    with pytest.raises(ValueError, match="size must be one of"):
        zoo.get_setting(arch, "huge")


def test_untied_gpt2_variant_differs_only_in_its_head_and_its_residual_group():
    """``gpt2_untied`` is ``gpt2`` with its own head: same config otherwise, and only it admits
    the orthogonal maps fixing 𝟙 on the residual stream (the tied one: permutations)."""
    import symgraph
    tied, untied = (zoo.make_config(a).to_dict() for a in ("gpt2", "gpt2_untied"))
    assert tied.pop("tie_word_embeddings") is True and untied.pop("tie_word_embeddings") is False
    assert tied == untied
    ids = torch.randint(1, 50, (2, 8))
    kinds = {}
    for arch in ("gpt2", "gpt2_untied"):
        r = symgraph.analyze(zoo.build_model(arch, 0), {"input_ids": ids})
        kinds[arch] = {g.kind for g in r.groups if g.size == zoo.get_setting(arch).hidden}
    assert "orthogonal_mean" in kinds["gpt2_untied"] and "orthogonal_mean" not in kinds["gpt2"]
    assert "gpt2_untied" in zoo.VARIANT_ARCHS and "gpt2_untied" not in zoo.ARCHS

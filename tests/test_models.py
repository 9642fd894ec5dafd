"""symgraph.testing.models: the one builder of tiny models (tests, benchmarks, demo, CLI, examples)
and the training loop shared by the benchmarks and the demo."""
from __future__ import annotations

import json

import pytest
import torch

from symgraph.testing import models


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _inputs(model):
    if model.main_input_name == "pixel_values":
        c = model.config
        return {"pixel_values": torch.randn(2, c.num_channels, c.image_size, c.image_size,
                                            generator=torch.Generator().manual_seed(0))}
    return {"input_ids": torch.randint(0, model.config.vocab_size, (2, 7),
                                       generator=torch.Generator().manual_seed(0))}


# --- config ----------------------------------------------------------------------------------


def test_overrides_land_under_hf_names():
    cfg = models.config("llama", vocab=50, hidden=48, layers=3, heads=6, kv_heads=3, mlp=80,
                        positions=16, rope_theta=500.0)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (50, 48, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (6, 3)
    assert (cfg.intermediate_size, cfg.max_position_embeddings) == (80, 16)
    assert cfg.rope_parameters["rope_theta"] == 500.0
    gpt = models.config("gpt2", hidden=24, layers=1, heads=3, mlp=None, positions=8)
    assert (gpt.n_embd, gpt.n_layer, gpt.n_head, gpt.n_inner, gpt.n_positions) == (24, 1, 3, None, 8)
    vit = models.config("vit", image_size=12, patch_size=3, channels=1, num_labels=7)
    assert (vit.image_size, vit.patch_size, vit.num_channels, vit.num_labels) == (12, 3, 1, 7)


def test_tiny_conventions():
    for arch in models.ARCHS:
        cfg = models.config(arch)
        assert cfg.architectures == [models.MODEL_CLASSES[arch]]
        assert all(getattr(cfg, f) == 0.0 for f in models.DROPOUT_FIELDS[arch]), arch
        assert cfg._attn_implementation == ("eager" if arch == "gptj" else "sdpa")
        if arch in models.DECODERS:
            assert cfg.use_cache is False
            assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 0, 0)
    assert models.config("bert").hidden_size == models.TINY["bert"]["hidden"] == 16
    assert models.config("gptj").rotary_dim == 4


def test_hf_base_keeps_hugging_face_defaults():
    cfg = models.config("gpt2", base="hf", vocab=100, hidden=32, layers=2, heads=4)
    assert (cfg.vocab_size, cfg.n_embd) == (100, 32)
    assert (cfg.resid_pdrop, cfg.n_positions, cfg.use_cache, cfg.bos_token_id) == (0.1, 1024, True, 50256)
    assert cfg.architectures == ["GPT2LMHeadModel"]


def test_dropout_use_cache_and_architectures_switches():
    cfg = models.config("bert", dropout=0.25)
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == 0.25
    assert models.config("gpt2", use_cache=None).use_cache is True  # None: the HF default
    assert models.config("llama", use_cache=True).use_cache is True
    assert models.config("vit", cls="ViTModel").architectures == ["ViTModel"]
    assert models.config("vit", architectures=None).architectures is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="t5"), "unknown architecture"),
    (dict(arch="bert", kv_heads=2), "has no size 'kv_heads'"),
    (dict(arch="vit", vocab=10), "has no size 'vocab'"),
    (dict(arch="bert", use_cache=False), "use_cache applies to decoders"),
    (dict(arch="gpt2", base="big"), "base must be"),
    (dict(arch="gpt2", cls="NoSuchModel"), "no model class"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.config(kwargs.pop("arch"), **kwargs)


# --- build -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", models.ARCHS)
def test_build_every_arch_is_seeded_and_runs(arch):
    a, b, c = models.build(arch, seed=4), models.build(arch, seed=4), models.build(arch, seed=5)
    assert type(a).__name__ == models.MODEL_CLASSES[arch] and not a.training
    assert _state_equal(a, b) and not _state_equal(a, c)
    with torch.no_grad():
        out = a(**_inputs(a))
    n_out = a.config.num_labels if arch == "vit" else a.config.vocab_size
    assert out.logits.shape[0] == 2 and out.logits.shape[-1] == n_out
    assert torch.isfinite(out.logits).all()


def test_build_seed_does_not_depend_on_global_rng_state():
    torch.manual_seed(123)
    torch.randn(10)
    a = models.build("gpt2", seed=0)
    torch.randn(100)
    assert _state_equal(a, models.build("gpt2", seed=0))


def test_build_class_and_meta_device():
    vit = models.build("vit", cls="ViTModel", image_size=16)
    assert type(vit).__name__ == "ViTModel" and vit.config.architectures == ["ViTModel"]
    meta = models.build("llama", device="meta")
    assert all(p.is_meta for p in meta.parameters())


def test_save_pretrained_round_trip_through_the_cli_loader(tmp_path):
    from symgraph.checkpoints.specs import load_local
    model = models.build("llama", seed=2, hidden=16, mlp=24)
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    loaded = load_local(str(tmp_path / "m"))
    assert type(loaded) is type(model) and _state_equal(model, loaded)


def test_hub_kernels_are_off_and_a_kernelized_model_is_traced_as_it_is(tmp_path, monkeypatch):
    """transformers ≥ 5.25 loads with ``use_kernels=True`` by default (layers' forwards swapped
    for kernels fetched from the Hub) and re-kernelizes on every ``train()``/``eval()``: the CLI
    loader turns them off, and the trace changes modes with torch's own ``train`` (a model the
    user loaded with kernels is neither re-kernelized nor refused on a device the kernels
    library does not know); every module's flag is put back."""
    import transformers

    import symgraph
    from symgraph.checkpoints.specs import load_local
    model = models.build("llama", seed=2, hidden=16, mlp=24)
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    loaded = load_local(str(tmp_path / "m"))
    if not hasattr(transformers.PreTrainedModel, "set_use_kernels"):
        assert not hasattr(loaded, "use_kernels")
        return
    assert loaded.use_kernels is False
    calls = []
    monkeypatch.setattr(type(loaded), "train", lambda self, mode=True: calls.append(mode) or self)
    loaded.model.layers[0].training = True  # one module in training mode: restored as it was
    rep = symgraph.analyze(loaded)
    assert calls == [] and rep.certify(loaded) < 1e-6
    assert loaded.model.layers[0].training and not loaded.model.norm.training


def test_callers_build_through_models():
    from symgraph.cli import demo, examples
    from symgraph.checkpoints import specs as io
    tiny = io.demo_model("tiny-llama")
    assert _state_equal(tiny, models.build("llama", 0, base="hf", **io._DEMO_SIZES["tiny-llama"][2]))
    assert io.demo_model("tiny-bert").config.hidden_dropout_prob == 0.1  # HF default, as always
    assert (tiny.config.vocab_size, tiny.config.bos_token_id, tiny.config.use_cache) == (128, 1, True)
    assert type(io.demo_model("tiny-vit")).__name__ == "ViTModel"
    ex = examples.build("vit")
    assert type(ex).__name__ == "ViTForImageClassification" and ex.config.num_labels == 10
    a, b = demo.make_model(1), demo.make_model(1)
    assert _state_equal(a, b) and a.config.vocab_size == 256 and a.config.n_inner is None
    assert (a.config.resid_pdrop, a.config.summary_first_dropout, a.config.pad_token_id) == (0.0, 0.1, None)


def test_benchmark_config_unchanged():
    """The zoo's configs are part of the checkpoint-cache fingerprint: recorded here for one
    arch (a transformers upgrade that changes the fields also changes the fingerprints)."""
    zoo = pytest.importorskip("benchmarks.zoo")
    recorded = {
        "_name_or_path": "", "architectures": None, "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "chunk_size_feed_forward": 0, "dtype": None, "eos_token_id": 0,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02,
        "intermediate_size": 256, "is_encoder_decoder": False,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "max_position_embeddings": 64, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "output_attentions": False, "output_hidden_states": False,
        "pad_token_id": 0, "pretraining_tp": 1, "problem_type": None, "return_dict": True,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": False, "vocab_size": 512,
    }
    got = zoo.make_config("llama", "quick").to_dict()
    got.pop("transformers_version", None)
    assert json.loads(json.dumps(got, sort_keys=True)) == recorded  # as the fingerprint hashes it
    gpt2 = zoo.make_config("gpt2", "full")
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_inner, gpt2.summary_first_dropout) == (128, 4, 512, 0.0)
    assert gpt2.architectures is None


# --- non-HF test models ----------------------------------------------------------------------


def test_randomize_vectors_touches_only_vectors_deterministically():
    base = models.mlp(seed=0)
    a = models.randomize_vectors(models.mlp(seed=0), seed=3)
    b = models.randomize_vectors(models.mlp(seed=0), seed=3)
    assert _state_equal(a, b)
    for (name, p0), p in zip(base.named_parameters(), a.parameters()):
        assert torch.equal(p0, p) == (p.dim() != 1), name
    norm = models.randomize_vectors(torch.nn.LayerNorm(4000), seed=1)
    assert abs(norm.weight.mean().item() - 1.0) < 0.05 and abs(norm.bias.mean().item()) < 0.05


def test_mlp_and_transformer_encoder():
    net = models.mlp(seed=1, widths=(3, 5, 4, 2), activations=("relu", "gelu"))
    assert [type(m).__name__ for m in net] == ["Linear", "ReLU", "Linear", "GELU", "Linear"]
    assert net(torch.zeros(7, 3)).shape == (7, 2) and not net.training
    assert _state_equal(net, models.mlp(seed=1, widths=(3, 5, 4, 2)))
    enc = models.transformer_encoder(seed=0, d=8, heads=2, ff=12, layers=3)
    assert len(enc.layers) == 3 and enc.layers[0].linear1.out_features == 12 and not enc.training
    assert enc(torch.randn(2, 5, 8)).shape == (2, 5, 8)
    with pytest.raises(ValueError):
        models.mlp(widths=(3,))


# --- train -----------------------------------------------------------------------------------


def _regression():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen)
    y = x @ torch.randn(6, 3, generator=gen)
    return {"x": x, "y": y}


def _mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def test_train_lowers_the_loss_and_respects_the_step_budget():
    model = models.mlp(seed=0)
    batch = _regression()
    seen = []
    threads = torch.get_num_threads()
    losses = models.train(model, lambda: batch, steps=40, lr=1e-2, loss_fn=_mse, threads=1,
                          progress=lambda step, loss, elapsed: seen.append((step, loss, elapsed)))
    assert len(losses) == 40 and losses[-1] < 0.3 * losses[0]
    assert [s for s, _, _ in seen] == list(range(1, 41)) and [l for _, l, _ in seen] == losses
    assert all(e >= 0 for _, _, e in seen)
    assert not model.training and torch.get_num_threads() == threads
    with torch.no_grad():
        assert _mse(model, batch).item() < losses[0]


def test_train_is_deterministic_and_time_budgeted():
    batch = _regression()
    a, b = models.mlp(seed=0), models.mlp(seed=0)
    la = models.train(a, lambda: batch, steps=5, lr=1e-2, loss_fn=_mse)
    lb = models.train(b, lambda: batch, steps=5, lr=1e-2, loss_fn=_mse)
    assert la == lb and _state_equal(a, b)
    assert models.train(models.mlp(), lambda: batch, seconds=0.0, loss_fn=_mse) == []
    assert len(models.train(models.mlp(), lambda: batch, seconds=0.05, loss_fn=_mse)) >= 1
    assert len(models.train(models.mlp(), lambda: batch, seconds=60, steps=3, loss_fn=_mse)) == 3
    with pytest.raises(ValueError, match="budget"):
        models.train(models.mlp(), lambda: batch, loss_fn=_mse)


def test_train_default_loss_is_the_hf_loss():
    model = models.build("gpt2", seed=0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = models.train(model, lambda: {"input_ids": ids, "labels": ids}, steps=8, lr=1e-2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("decay_vectors", [False, True])
def test_weight_decay_on_matrices_only_unless_asked(decay_vectors):
    model = models.mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def zero_grad_loss(m, _batch):  # zero gradients: AdamW only decays
        return sum((p * 0).sum() for p in m.parameters())

    models.train(model, lambda: None, steps=1, lr=0.1, loss_fn=zero_grad_loss, weight_decay=0.5,
                 decay_vectors=decay_vectors)
    for k, v in model.state_dict().items():
        shrink = v.dim() >= 2 or decay_vectors
        assert torch.allclose(v, before[k] * (0.95 if shrink else 1.0)), k


def test_schedule_scales_the_learning_rate():
    batch = _regression()
    model = models.mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    models.train(model, lambda: batch, steps=3, lr=1e-2, loss_fn=_mse, schedule=lambda step: 0.0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_warmup_cosine():
    f = models.warmup_cosine(100, warmup_fraction=0.1, min_lr_fraction=0.2)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.2 + 0.8 * 0.5) and f(100) == pytest.approx(0.2)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))
    assert models.warmup_cosine(3)(0) == 1.0  # at least one warm-up step


def test_mixtral_is_a_mixture_of_experts_with_an_expert_permutation_class():
    import symgraph
    cfg = models.config("mixtral")
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    model = models.build("mixtral", seed=0)
    report = symgraph.analyze(model, _inputs(model)["input_ids"])
    for layer in range(cfg.num_hidden_layers):
        mlp = f"model.layers.{layer}.mlp"
        (experts,) = report.group_of(f"{mlp}.gate.weight", 0)  # the router's rows
        assert (experts.kind, experts.size) == ("perm", cfg.num_local_experts)
        assert (f"{mlp}.experts.gate_up_proj", 0) in experts.params
        (hidden,) = report.group_of(f"{mlp}.experts.down_proj", 2)
        # one hidden-unit order per expert
        assert (hidden.kind, hidden.dim, hidden.blocks) == ("perm", cfg.intermediate_size,
                                                            cfg.num_local_experts)
        assert hidden.outer == [experts.id]

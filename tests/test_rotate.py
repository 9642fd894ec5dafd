"""symgraph.rotate (issue 64): function-preserving rotations for quantization on tiny configs of
many families, certified in float32, saved and reloaded with transformers."""
from __future__ import annotations

import math

import pytest
import torch

import symgraph
from symgraph.core.hadamard import hadamard, incoherent
from symgraph import rotate
from symgraph.testing import models

from function_helpers import logits, rel

transformers = pytest.importorskip("transformers")

V = 64


def _cfg(name, **kw):
    return getattr(transformers, name)(vocab_size=V, use_cache=False, **kw)


LM = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
          max_position_embeddings=32)


def families():
    """Name -> builder of a tiny model with random weights and non-trivial norm gains."""
    tf = transformers
    return {
        "llama": lambda: models.build("llama", seed=0),
        "llama_tied": lambda: models.build("llama", seed=0, tie_word_embeddings=True),
        "qwen2": lambda: tf.Qwen2ForCausalLM(_cfg("Qwen2Config", num_key_value_heads=2, **LM)),
        "phi3": lambda: tf.Phi3ForCausalLM(_cfg("Phi3Config", num_key_value_heads=2, pad_token_id=0, **LM)),
        "mistral": lambda: tf.MistralForCausalLM(_cfg("MistralConfig", num_key_value_heads=1, **LM)),
        "gemma": lambda: tf.GemmaForCausalLM(_cfg("GemmaConfig", num_key_value_heads=1, head_dim=8, **LM)),
        "gpt2": lambda: models.build("gpt2", seed=0),
        "opt": lambda: tf.OPTForCausalLM(_cfg("OPTConfig", hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, ffn_dim=48, max_position_embeddings=32,
                                              word_embed_proj_dim=32)),
        "bert": lambda: models.build("bert", seed=0),
        "mixtral": lambda: models.build("mixtral", seed=0),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(_cfg(
            "Qwen3MoeConfig", hidden_size=32, intermediate_size=24, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, max_position_embeddings=32)),
        "phi": lambda: models.build("phi", seed=0),
        "neox": lambda: models.build("neox", seed=0),
    }


def built(name):
    torch.manual_seed(0)
    m = families()[name]().eval()
    return models.randomize_vectors(m, seed=1)  # norm gains and biases away from 1 and 0


def ids(n=9, seed=2):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


#: Families whose residual stream rotates (Gemma's ``x · (1 + w)`` gains fold with their offset).
#: The other: BERT's post-norm stream.
STREAM = {"llama", "llama_tied", "qwen2", "phi3", "mistral", "gemma", "gpt2", "opt", "mixtral", "qwen3_moe",
          "phi", "neox"}


@pytest.mark.parametrize("name", list(families()))
@pytest.mark.slow
def test_rotate_certifies_saves_and_reloads(name, tmp_path):
    model = built(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = rotate(model, how="hadamard", seed=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # input untouched
    assert type(res.model) is type(model)
    x = ids()
    base, got = logits(model, x), logits(res.model, x)
    assert rel(base, got) <= 1e-5 and res.error <= 1e-5
    assert bool(res.roles["vo"])
    assert bool(res.roles["stream"]) == (name in STREAM)
    moved = [k for k, v in res.model.state_dict().items() if k in before and not torch.equal(before[k], v)]
    assert len(moved) >= 4
    for f in res.report.folds:  # every folded gain is the identity (1 − offset stored), every folded shift zero
        g = res.model.get_parameter(f.gain)
        assert torch.equal(g, torch.full_like(g, 1 - f.offset)), f.gain
        if f.shift and not f.keep_shift:
            b = res.model.get_parameter(f.shift)
            assert torch.equal(b, torch.zeros_like(b)), f.shift
    for gid in res.roles["stream"] + res.roles["vo"]:  # the elements are rotations
        E = res.elements[gid]
        eye = torch.eye(E.shape[-1], dtype=E.dtype)
        assert float((E @ E.mT - eye).abs().max()) < 1e-12
    if name == "llama_tied":
        assert res.untied and res.model.config.tie_word_embeddings is False
    res.model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path, trust_remote_code=False).eval()
    assert type(back) is type(model)
    assert rel(base, logits(back, x)) <= 1e-5
    assert torch.equal(logits(back, x), got)


def test_gemma_offset_gains_fold_with_their_offset():
    """Gemma's RMSNorm reads ``1 + w``: the analysis folds ``diag(1 + w)`` into the readers and
    the rotated model stores ``w = 0``; folding as if the gain were ``w`` (no offset) would not
    keep the function, and the certificate says so."""
    from dataclasses import replace
    from symgraph.rotation.classes import certificate, rotation_report
    from symgraph.transform import folding
    from symgraph.transform.apply import stored_tensors
    model = built("gemma")
    res = rotate(model, how="hadamard", seed=0)
    assert res.untied and res.roles["stream"] and res.error <= 1e-5
    assert len(res.report.folds) == 5 and {f.offset for f in res.report.folds} == {1.0}
    for f in res.report.folds:
        w = model.get_parameter(f.gain)
        assert float(w.abs().min()) > 0 and torch.equal(res.model.get_parameter(f.gain), torch.zeros_like(w))
    assert res.report.certify(res.model) <= 1e-6
    base, report, _ = rotation_report(model)
    tensors = stored_tensors(report, base)
    assert certificate(base, folding.fold(report.folds, tensors), report) <= 1e-6
    wrong = folding.fold([replace(f, offset=0.0) for f in report.folds], tensors)
    assert certificate(base, wrong, report) > 1e-2


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma2_and_gemma3_post_norms_keep_the_stream(name):
    """Gemma 2 and 3 also normalise each branch's output on the stream (``h + (1 + w) ⊙
    rms(o_proj z)``): that gain has no linear reader to fold into, so the stream admits only
    permutations (the report says so, no fold kept) and ``rotate`` rotates the heads'
    value-output maps (Gemma 2's softcapped eager attention is a site too: passes/sites.py), certified."""
    tf = transformers
    cfg = dict(num_key_value_heads=2, head_dim=8, **LM)
    make = {"gemma2": lambda: tf.Gemma2ForCausalLM(_cfg("Gemma2Config", **cfg)),
            "gemma3": lambda: tf.Gemma3ForCausalLM(_cfg("Gemma3TextConfig", **cfg))}[name]
    torch.manual_seed(0)
    model = models.randomize_vectors(make().eval(), seed=1)
    res = rotate(model, how="hadamard", seed=0)
    assert res.roles["stream"] == [] and res.report.folds == [] and not res.untied
    assert len(res.roles["vo"]) == 2  # one per layer
    assert res.error <= 1e-5 and rel(logits(model, ids()), logits(res.model, ids())) <= 1e-5


def test_stream_rotation_spreads_an_outlier_channel():
    """The Hadamard stream element is incoherent: an embedding column (one stream channel)
    spreads evenly over every coordinate."""
    model = built("llama")
    res = rotate(model, how="hadamard", seed=3)
    (gid,) = res.roles["stream"]
    E = res.elements[gid]
    assert float(E.abs().max()) == pytest.approx(1 / math.sqrt(32), rel=1e-12)
    rnd = rotate(model, how="random", seed=3)
    assert rnd.error <= 1e-5
    assert not torch.allclose(rnd.elements[gid], E)


def test_layernorm_stream_elements_fix_the_all_ones_vector():
    res = rotate(built("gpt2"), how="hadamard", seed=1)
    (gid,) = res.roles["stream"]
    assert next(g for g in res.report.groups if g.id == gid).kind == "orthogonal_mean"
    E = res.elements[gid]
    one = torch.ones(E.shape[-1], dtype=E.dtype)
    assert float((E @ one - one).abs().max()) < 1e-12
    assert not torch.allclose(E, torch.eye(E.shape[-1], dtype=E.dtype))


def test_tied_head_kept_rotates_only_the_heads():
    res = rotate(built("llama_tied"), untie=False)
    assert not res.untied and res.roles["stream"] == [] and res.roles["vo"]
    assert res.model.config.tie_word_embeddings
    assert res.model.lm_head.weight is res.model.model.embed_tokens.weight
    assert res.error <= 1e-5


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 24, 44, 96, 768, 1536, 5632])
@pytest.mark.slow
def test_hadamard_orders(n):
    H = hadamard(n)
    assert H is not None
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.float64))
    assert bool((H[0] == 1).all() and (H[:, 0] == 1).all())


def test_no_hadamard_falls_back_to_random_orthogonal():
    assert hadamard(6) is None and hadamard(28) is None
    E = incoherent("orthogonal", 6, torch.Generator().manual_seed(0), batch=(2,))
    assert float((E @ E.mT - torch.eye(6, dtype=E.dtype)).abs().max()) < 1e-12


def test_bad_arguments_refused():
    model = built("llama")
    with pytest.raises(symgraph.InputError, match="how="):
        rotate(model, how="sideways")
    with pytest.raises(symgraph.InputError, match="needs data"):
        rotate(model, how="learned")
    with pytest.raises(symgraph.InputError, match="rotation classes"):
        rotate(model, classes=("mlp",))
    with pytest.raises(symgraph.InputError, match="learned"):
        rotate(model, steps=3)
    ids = {"input_ids": torch.tensor([[1, 2, 3]])}
    with pytest.raises(symgraph.InputError, match=r"^options \['data'\] are for how='learned' only; expected "
                       r"how='learned' or no data$"):  # a Hadamard rotation reads no data: refused, not ignored
        rotate(model, data=[ids])
    with pytest.raises(symgraph.InputError, match=r"^'input_ids' of data\[1\] range over \[1, 999\]"):
        rotate(model, how="learned", data=[ids, {"input_ids": torch.tensor([[1, 999]])}], steps=1)


def test_bf16_model_keeps_its_dtype_and_certifies_before_rounding():
    model = built("llama").to(torch.bfloat16)
    res = rotate(model)
    assert res.error <= 1e-5
    assert {p.dtype for p in res.model.parameters()} == {torch.bfloat16}
    x = ids()
    base, got = logits(model.float(), x), logits(res.model.float(), x)
    assert rel(base, got) < 0.05  # bf16 rounding of the rotated weights only

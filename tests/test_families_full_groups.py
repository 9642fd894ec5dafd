"""Exact recovery of the full groups on 22 families no per-model code names: a
``random_transform(seed=0)`` of the model (full groups: GL per head on QK and VO, RoPE's scaled
rotations, ReLU's scaled permutations, not only their orthogonal part) merged back into it by
weights and by activations with ``full_groups=True`` (Hugging Face classes built from tiny
configs; the eight of ``symgraph.testing.models`` plus fourteen more)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.testing import models

V = 64
_T = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
MORE = {
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_T, num_key_value_heads=2, intermediate_size=64,
                                                        max_position_embeddings=32)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**_T, num_key_value_heads=2, intermediate_size=64,
                                                     max_position_embeddings=32, pad_token_id=0)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**_T, num_key_value_heads=1, head_dim=8, intermediate_size=64,
                                                        max_position_embeddings=32)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**_T, ffn_dim=64, max_position_embeddings=32, word_embed_proj_dim=32)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_T, num_key_value_heads=2, intermediate_size=64,
                                                              max_position_embeddings=32)),
    "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**_T, num_key_value_heads=2, intermediate_size=64,
                                                                       max_position_embeddings=32)),
    "olmo": lambda: tf.OlmoForCausalLM(tf.OlmoConfig(**_T, num_key_value_heads=2, intermediate_size=64,
                                                     max_position_embeddings=32, pad_token_id=0)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(**_T, multi_query=True, new_decoder_architecture=False,
                                                           parallel_attn=True, bias=False)),
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**_T, num_key_value_heads=2, intermediate_size=64,
                                                                 max_position_embeddings=32)),
    "distilbert": lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                                       hidden_dim=64, max_position_embeddings=32)),
    "roberta": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(**_T, intermediate_size=64, max_position_embeddings=40)),
    "electra": lambda: tf.ElectraForMaskedLM(tf.ElectraConfig(**_T, embedding_size=32, intermediate_size=64,
                                                              max_position_embeddings=32)),
    "modernbert": lambda: tf.ModernBertForMaskedLM(tf.ModernBertConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "deit": lambda: tf.DeiTForImageClassification(tf.DeiTConfig(image_size=16, patch_size=4, hidden_size=32,
                                                                 num_hidden_layers=2, num_attention_heads=4,
                                                                 intermediate_size=64, num_labels=5)),
}
FAMILIES = list(models.ARCHS) + list(MORE)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation
    yield
    torch.set_num_threads(n)


def _rel(A, B) -> float:
    num = sum(float((p.detach().double() - q.detach().double()).norm() ** 2) for p, q in zip(A.parameters(), B.parameters()))
    return (num / sum(float(p.detach().double().norm() ** 2) for p in A.parameters())) ** 0.5


def _batches(A, n=3):
    g = torch.Generator().manual_seed(0)
    if getattr(A, "main_input_name", "") == "pixel_values":
        size = A.config.image_size
        return [{"pixel_values": torch.randn(4, 3, size, size, generator=g)} for _ in range(n)]
    return [{"input_ids": torch.randint(0, A.config.vocab_size, (4, 16), generator=g)} for _ in range(n)]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_transformed_copy_merges_back_by_weights_and_activations(name):
    torch.manual_seed(0)
    A = (models.build(name, seed=0) if name in models.ARCHS else MORE[name]()).eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=0))
    assert _rel(A, B) > 0.1
    for data in (None, _batches(A)):
        al = symgraph.align(A, B, data=data, report_a=rep, full_groups=True)
        assert _rel(A, al.apply(B)) < 1e-6, (name, "weights" if data is None else "activations")


def test_roberta_gathers_token_types_without_freezing():
    """RoBERTa gathers its token types by position ids (``torch.gather`` on a buffer): the
    gather rule leaves nothing frozen."""
    A = MORE["roberta"]().eval()
    rep = symgraph.analyze(A)
    assert rep.frozen == [] and rep.certify(A) < 1e-6


def test_falcon_multi_query_has_head_classes():
    """Falcon's multi-query split (``qkv.view(..., heads + 2, d)[..., :-2, :]``, ``[..., [-2], :]``,
    ``[..., [-1], :]``): the packed axis is a sum of the query heads, the key head and the value
    head (literal index lists read as ranges), so the query heads are a class, the shared key
    head's RoPE rotation one element for all of them, and the shared value head a GL class of its
    own (one element, its inverse on every head's block of the output projection)."""
    A = MORE["falcon"]().eval()
    rep = symgraph.analyze(A)
    attn = [(g.kind, g.size, g.blocks) for g in rep.groups if g.module.endswith("self_attention")]
    assert ("perm", 4, 1) in attn and ("gl", 8, 1) in attn
    assert [(g.kind, g.size) for g in rep.groups if g.module.endswith("query_key_value")] == [("rope", 8)] * 2
    assert rep.frozen == [] and rep.certify(A) < 1e-6


def test_modernbert_packed_qkv_has_qk_and_vo_classes_per_head():
    """ModernBERT packs Q, K and V as ``Wqkv(x).view(b, s, 3, H, d).unbind(dim=-3)``: the packed
    axis is a sum of three ``H × d`` parts, so each head gets a RoPE class on QK and a GL class
    on VO, as in separate projections (one shared class for Q, K and V before)."""
    A = MORE["modernbert"]().eval()
    rep = symgraph.analyze(A)
    kinds = sorted((g.kind, g.size, g.blocks) for g in rep.groups if ".attn" in g.module)
    assert kinds == sorted([("perm", 4, 1), ("gl", 32, 4), ("rope", 32, 4)] * 2)
    assert rep.frozen == [] and rep.certify(A) < 1e-6

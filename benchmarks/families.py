"""The 22 tested families: tiny Hugging Face models whose transformed copies the tests recover
exactly with the full groups (``tests/test_families_full_groups.py``) and the provenance
benchmark compares: the eight of :data:`symgraph.testing.models.ARCHS` plus fourteen built here."""
from __future__ import annotations

import torch
import transformers as tf

from symgraph.testing import models

V = 64
_T = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
_D = dict(_T, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)  # a GQA decoder's
MORE = {
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_D)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**_D, pad_token_id=0)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**(_D | dict(num_key_value_heads=1, head_dim=8)))),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**_T, ffn_dim=64, max_position_embeddings=32,
                                                  word_embed_proj_dim=32)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_D)),
    "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**_D)),
    "olmo": lambda: tf.OlmoForCausalLM(tf.OlmoConfig(**_D, pad_token_id=0)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(**_T, multi_query=True, new_decoder_architecture=False,
                                                           parallel_attn=True, bias=False)),
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**_D)),
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


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """Family ``name``'s tiny model, random weights (``seed``), in ``eval()`` mode."""
    if name in models.ARCHS:
        return models.build(name, seed=seed).eval()
    if name not in MORE:
        raise ValueError(f"unknown family {name!r}; expected one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    return MORE[name]().eval()


def batches(model, n: int = 3, seed: int = 0) -> list:
    """``n`` batches of random inputs for ``model`` (pixels for an image model, else token ids)."""
    g = torch.Generator().manual_seed(seed)
    if getattr(model, "main_input_name", "") == "pixel_values":
        size = model.config.image_size
        return [{"pixel_values": torch.randn(4, 3, size, size, generator=g)} for _ in range(n)]
    return [{"input_ids": torch.randint(0, model.config.vocab_size, (4, 16), generator=g)} for _ in range(n)]

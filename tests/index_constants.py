"""A forward that creates tensor constants on its weights' device: Falcon's multi-query attention
as transformers wrote it before 5.25, the packed projection taken apart by literal index lists
(``qkv[..., [-2], :]``, ``qkv[..., [-1], :]``). Traced on ``meta`` those index tensors hold no
values, which the trace takes from a fake-CPU twin (``passes.trace._constants_from_fake_twin``).
transformers 5.25 takes the projection apart with ``split`` (no constants), so the tests of such
constants put this forward back with :func:`index_split_falcon`."""
from __future__ import annotations

import torch
import transformers
from transformers.models.falcon import modeling_falcon

__all__ = ["falcon_config", "index_split_falcon"]


def falcon_config(layers: int = 2, **extra) -> transformers.FalconConfig:
    """A tiny multi-query Falcon (4 query heads of 8, one key and one value head, RoPE)."""
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                    multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                    bias=False, **extra)
    cfg.architectures = ["FalconForCausalLM"]
    return cfg


def _forward(self, hidden_states, attention_mask=None, position_ids=None, layer_past=None, use_cache=False,
             output_attentions=False, position_embeddings=None, alibi=None, **kwargs):
    shape = hidden_states.shape[:-1]
    qkv = self.query_key_value(hidden_states).view(*shape, self.num_heads + 2, self.head_dim)
    q, k, v = (t.transpose(1, 2) for t in (qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]))
    cos, sin = position_embeddings
    q, k = modeling_falcon.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (t.expand(-1, self.num_heads, -1, -1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None, scale=self.inv_norm_factor)
    return self.dense(out.transpose(1, 2).reshape(*shape, -1)), None


def index_split_falcon(monkeypatch) -> None:
    """Every ``FalconAttention`` of this test runs the index-list forward (multi-query, RoPE)."""
    monkeypatch.setattr(modeling_falcon.FalconAttention, "forward", _forward)

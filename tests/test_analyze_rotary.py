"""``symgraph.analyze`` on real architectures with partial (Phi, GPT-NeoX) and interleaved
(GPT-J) rotary embeddings: the rope groups, their pairs and the pass-through part of Q/K."""
from __future__ import annotations

from analyze_helpers import TOL, in_layer, one, slots


# --- partial and interleaved rotary -------------------------------------------------------
def test_partial_rotary_phi(phi):
    cfg = phi.config
    heads = cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    factor = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor") \
        or getattr(cfg, "partial_rotary_factor")  # transformers 5 moved it into rope_parameters
    rot = int(head_dim * factor)
    assert 0 < rot < head_dim
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.self_attn."
        groups = in_layer(phi.report.groups, pre)
        rope = one([g for g in groups if g.kind == "rope"], "rope group")
        assert (rope.blocks, rope.dim) == (heads, rot)
        assert rope.pairs == tuple((j, j + rot // 2) for j in range(rot // 2))
        qk_slots = {(pre + "q_proj.weight", 0), (pre + "q_proj.bias", 0),
                    (pre + "k_proj.weight", 0), (pre + "k_proj.bias", 0)}
        assert slots(rope) == qk_slots
        # the pass-through part of Q/K is a separate, full GL group per head
        rest = one([g for g in groups if g.kind == "gl" and slots(g) == qk_slots], "non-rotary QK group")
        assert (rest.blocks, rest.dim) == (heads, head_dim - rot)
        vo = one([g for g in groups if g.kind == "gl" and (pre + "dense.weight", 1) in g.params], "VO")
        assert (vo.blocks, vo.dim) == (heads, head_dim)
        hp = one([g for g in groups if g.kind == "perm" and g.size == heads], "head perm")
        assert rope.outer == rest.outer == vo.outer == [hp.id]
    assert phi.report.certify(phi.model) <= TOL


def test_partial_rotary_neox_fused_qkv(neox):
    # fused QKV split with chunk (a composite op: symgraph re-traces to decompose it)
    cfg = neox.config
    heads = cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    assert neox.report.frozen == []
    for i in range(cfg.num_hidden_layers):
        pre = f"gpt_neox.layers.{i}.attention."
        groups = in_layer(neox.report.groups, pre)
        rope = one([g for g in groups if g.kind == "rope"], "rope group")
        assert (rope.blocks, rope.dim) == (heads, head_dim // 2)
        assert set(rope.params) == {(pre + "query_key_value.weight", 0), (pre + "query_key_value.bias", 0)}
        assert sorted(rope.variance) == ["co", "co", "contra", "contra"]  # Q rows co, K rows contra
        rest = [g for g in groups if g.kind == "gl" and g.dim == head_dim - rope.dim]
        vo = [g for g in groups if g.kind == "gl" and (pre + "dense.weight", 1) in g.params]
        assert len(rest) == 1 and len(vo) == 1 and vo[0].dim == head_dim
    assert neox.report.certify(neox.model) <= TOL


def test_interleaved_rotary_gptj(gptj):
    cfg = gptj.config
    head_dim = cfg.n_embd // cfg.n_head
    for i in range(cfg.n_layer):
        pre = f"transformer.h.{i}.attn."
        groups = in_layer(gptj.report.groups, pre)
        rope = one([g for g in groups if g.kind == "rope"], "rope group")
        assert (rope.blocks, rope.dim) == (cfg.n_head, cfg.rotary_dim)
        assert rope.pairs == tuple((2 * j, 2 * j + 1) for j in range(cfg.rotary_dim // 2))  # GPT-J pairs
        rest = one([g for g in groups if g.kind == "gl" and (pre + "k_proj.weight", 0) in g.params],
                   "non-rotary QK group")
        assert rest.dim == head_dim - cfg.rotary_dim
    assert gptj.report.certify(gptj.model) <= TOL

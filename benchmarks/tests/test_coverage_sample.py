"""The library coverage benchmark (``benchmarks/coverage/``) on a fixed sample of families,
through the benchmark's own functions: the shrink rule, one row per family (traced, sound,
complete, the expected classes found), a failure recorded as a row, and the summary."""
from __future__ import annotations

import pytest

from benchmarks import coverage as cov

SAMPLE = [("llama", "LlamaForCausalLM", "causal_lm"), ("gpt2", "GPT2LMHeadModel", "causal_lm"),
          ("bert", "BertForMaskedLM", "masked_lm"), ("vit", "ViTForImageClassification", "image_cls")]


@pytest.fixture(scope="module")
def rows():
    return {fam[0]: cov.run_family(*fam) for fam in SAMPLE}


def test_sample_is_in_the_auto_mappings():
    fams = cov.families(only=[f[0] for f in SAMPLE])
    for fam in SAMPLE:
        assert fam in fams


def test_shrink_rule_keeps_divisibility():
    cfg, over = cov.tiny_config("llama")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (64, 4, 2)
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
    assert cfg.vocab_size == cov.VOCAB and 8 < cfg.intermediate_size < 1000
    # GPT-2: n_embd scaled, token ids moved inside the shrunk vocabulary
    g, _ = cov.tiny_config("gpt2")
    assert (g.n_embd, g.n_head, g.n_layer) == (64, 4, 2)
    assert g.bos_token_id < g.vocab_size and g.eos_token_id < g.vocab_size
    # a grouped-query default stays grouped: kv heads divide heads and differ from them
    over = cov.shrink(type(cfg)(num_attention_heads=32, num_key_value_heads=8))
    assert over["num_attention_heads"] == 4 and over["num_key_value_heads"] == 2
    assert cov.role("max_position_embeddings") is None and cov.role("patch_size") is None


def test_shrink_rule_fills_expert_counts_left_none_beside_an_moe_width():
    # Dots1 (and DeepSeek-V2's experts per token) default the counts to None with an MoE width
    # set: the model would build torch.empty(None, ...) or topk(k=None)
    cfg, over = cov.tiny_config("dots1")
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok) == (
        cov.EXPERTS, 1, cov.EXPERTS_PER_TOKEN) and cfg.moe_intermediate_size == 16
    assert cov.tiny_config("deepseek_v2")[0].num_experts_per_tok == cov.EXPERTS_PER_TOKEN
    # set counts are shrunk as before; without a positive MoE width a None count stays None
    over = cov.shrink(type(cfg)(n_routed_experts=128, n_shared_experts=None, num_experts_per_tok=8))
    assert (over["n_routed_experts"], over["n_shared_experts"], over["num_experts_per_tok"]) == (4, 1, 2)
    over = cov.shrink(type(cfg)(moe_intermediate_size=0))
    assert not {"n_routed_experts", "n_shared_experts", "num_experts_per_tok"} & set(over)


@pytest.mark.parametrize("name", [f[0] for f in SAMPLE])
def test_sample_family_traced_sound_complete(rows, name):
    r = rows[name]
    assert r["error"] is None, r["error"]
    assert r["traced"] and r["stage"] == "done"
    assert r["certificate"] is not None and r["certificate"] <= cov.TOL and r["sound"]
    st = r["structure"]
    assert r["complete"] and st["missing"] == [], st["missing"]
    assert st["mlps"] == 2                      # one MLP per layer, each with its permutation class
    assert st["multihead_attention"] == 2       # one head-structured class set per attention layer
    assert r["analyze_seconds"] > 0 and isinstance(r["unruled_ops"], dict)


def test_expected_classes_found(rows):
    assert rows["llama"]["structure"]["rope_expected"] and rows["llama"]["structure"]["rope_classes"] == 2
    assert rows["llama"]["group_kinds"].get("rope") == 2
    for name in ("gpt2", "bert", "vit"):
        assert not rows[name]["structure"]["rope_expected"]
        assert rows[name]["group_kinds"].get("perm", 0) >= 2


def test_failure_is_a_row_and_summary(rows):
    bad = cov.run_family("llama", "NoSuchModelForCausalLM", "causal_lm")
    assert not bad["traced"] and bad["error"]["stage"] == "build" and bad["error"]["type"] == "ImportError"
    all_rows = list(rows.values()) + [bad]
    s = cov.summarize(all_rows)
    assert (s["tried"], s["traced"], s["sound"], s["complete"]) == (5, 4, 4, 4)
    assert s["causal_lm"]["traced"] == 2 and s["causal_lm"]["complete_fraction"] == 1.0
    res = {"header": {"command": "python -m benchmarks.coverage --only llama", "git": cov.git_info(),
                      "machine": {"transformers": "x", "torch": "y", "cores": 2}, "jobs": 1, "threads": 1,
                      "timeout_s": 120.0, "mem_gb": 6, "wall_seconds": 1.0, "rule": cov.RULE},
           "summary": s, "rows": all_rows}
    md = cov.markdown(res)
    assert "python -m benchmarks.coverage --only llama" in md and res["header"]["git"]["commit"][:7] in md
    assert "NoSuchModelForCausalLM" in md

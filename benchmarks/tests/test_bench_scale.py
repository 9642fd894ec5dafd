"""``benchmarks.bench_scale``: the meta-device checkpoint writer lays a checkpoint out exactly as
``save_pretrained`` does and ``from_pretrained`` loads it completely in bf16 with the seeded
values; the measuring wrapper reports a child's own peak RSS (not the largest child's so far),
its return code, last stderr line and timeout. mergekit is not run here."""
from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import bench_scale as bs

MiB = 2 ** 20


@pytest.mark.parametrize("shard", ["5MB", "1GB"])
def test_writer_matches_save_pretrained_and_loads_in_bf16(tmp_path, shard):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    cfg = bs.llama_config("tiny")
    info = bs.write_checkpoint(tmp_path / "ours", cfg, seed=7, max_shard_size=shard)
    ours = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert info["shards"] == (2 if shard == "5MB" else 1)  # the tiny model is ~7 MB

    # the reference layout: a materialised bf16 model through save_pretrained
    ref = LlamaForCausalLM(bs.llama_config("tiny")).to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "ref", max_shard_size=shard)
    del ref
    assert ours == sorted(p.name for p in (tmp_path / "ref").iterdir())
    for name in ours:
        if name.endswith(".json"):  # index (total_parameters, total_size, weight_map), config, generation
            assert (tmp_path / "ours" / name).read_text() == (tmp_path / "ref" / name).read_text(), name

    model, load = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not load["missing_keys"] and not load["unexpected_keys"] and not load["mismatched_keys"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    sd = model.state_dict()
    for k in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(sd[k], bs.make_tensor(k, sd[k].shape, 7)), k
        assert 0.018 < float(sd[k].float().std()) < 0.022
    assert torch.equal(sd["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    assert torch.equal(sd["model.layers.0.input_layernorm.weight"], torch.ones(256, dtype=torch.bfloat16))
    # the seeding restated: the generator seed of a tensor is a function of (model seed, name) only
    import zlib
    g = torch.Generator().manual_seed((7 * 1_000_003 + zlib.crc32(b"lm_head.weight")) % 2 ** 63)
    expect = (torch.randn(4096, 256, generator=g) * 0.02).to(torch.bfloat16)
    assert torch.equal(sd["lm_head.weight"], expect)


def test_two_seeds_differ():
    shape = (64, 32)
    a = bs.make_tensor("model.layers.0.self_attn.q_proj.weight", shape, 0)
    b = bs.make_tensor("model.layers.0.self_attn.q_proj.weight", shape, 1)
    c = bs.make_tensor("model.layers.0.self_attn.k_proj.weight", shape, 0)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, bs.make_tensor("model.layers.0.self_attn.q_proj.weight", shape, 0))


def test_wrapper_reports_the_childs_own_peak_rss():
    big = bs.measure([sys.executable, "-c", "b = b'x' * (300 << 20); print(len(b))"], timeout=120)
    assert big["rc"] == 0 and not big["timed_out"] and big["stdout"].strip() == str(300 << 20)
    assert 300 * MiB <= big["peak_rss_bytes"] <= 400 * MiB, big["peak_rss_bytes"] / MiB
    assert big["wall_s"] > 0 and big["user_s"] + big["sys_s"] > 0
    # a small child measured afterwards reports its own figure, not the big one's
    small = bs.measure([sys.executable, "-c", "pass"], timeout=120)
    assert small["rc"] == 0 and small["peak_rss_bytes"] < 100 * MiB, small["peak_rss_bytes"] / MiB


def test_wrapper_records_failure_and_timeout():
    bad = bs.measure([sys.executable, "-c", "import sys; print('first'); sys.exit('the last line')"],
                     timeout=120)
    assert bad["rc"] == 1 and bad["error"] == "the last line"
    slow = bs.measure([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert slow["timed_out"] and slow["rc"] != 0 and slow["wall_s"] < 30
    assert "timed out" in slow["error"]


def test_155m_shape_has_155m_parameters():
    from benchmarks.scale.checkpoints import model_sizes
    sizes = model_sizes(bs.llama_config("155m"))
    assert 155.0e6 < sizes["parameters"] < 155.6e6
    assert sizes["parameters"] == 155_339_520


def test_merge_commands_name_the_method_the_data_and_the_budget():
    from benchmarks.bench_scale import merge_command
    reg = merge_command("symgraph_regmean", "A", "B", "O", data="D", memory_budget="256MB")
    i = reg.index("merge")
    assert reg[i:] == ["merge", "A", "B", "--out", "O", "--align", "weights", "--method", "regmean",
                       "--data", "D", "--memory-budget", "256MB"]
    rep = merge_command("symgraph_repair", "A", "B", "O", data="D", memory_budget="256MB")
    assert rep[rep.index("merge"):] == ["merge", "A", "B", "--out", "O", "--align", "weights", "--repair",
                                        "--data", "D", "--memory-budget", "256MB"]
    w = merge_command("symgraph_weights", "A", "B", "O")
    assert "--memory-budget" not in w and "--data" not in w and "--max-iter" not in w
    w3 = merge_command("symgraph_weights_baseline", "A", "B", "O", max_iter=3)
    assert w3[w3.index("merge"):] == ["merge", "A", "B", "--out", "O", "--align", "weights", "--method", "average",
                                      "--max-iter", "3"]
    assert "--max-iter" not in merge_command("symgraph_none", "A", "B", "O", max_iter=3)
    with pytest.raises(ValueError, match="data missing"):
        merge_command("symgraph_repair", "A", "B", "O")
    with pytest.raises(ValueError, match="not read"):
        merge_command("symgraph_weights", "A", "B", "O", data="D")


def test_a_bad_memory_budget_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(["--shapes", "155m", "--stages", "symgraph_regmean", "--memory-budget", "lots"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--memory-budget 'lots'" in err and "256MB" in err


def test_the_baseline_stage_runs_another_commits_tree(tmp_path, capsys):
    import subprocess
    from benchmarks.bench_scale import baseline_tree, merge_command
    base = merge_command("symgraph_weights_baseline", "A", "B", "O")
    assert base[:3] == [sys.executable, "-m", "symgraph"]  # found in the tree it runs in
    w = merge_command("symgraph_weights", "A", "B", "O")
    assert base[3:] == w[w.index("merge"):]
    ref = "HEAD~1"
    tree = baseline_tree(tmp_path, ref)
    want = subprocess.run(["git", "rev-parse", ref], capture_output=True, text=True, check=True).stdout.strip()
    assert tree["commit"] == want and tree["dir"].endswith(want[:12])
    shown = subprocess.run(["git", "show", f"{want}:symgraph/__init__.py"], capture_output=True, check=True).stdout
    assert (tmp_path / f"baseline-{want[:12]}" / "symgraph" / "__init__.py").read_bytes() == shown
    for argv in (["--stages", "symgraph_weights_baseline"], ["--baseline", "HEAD"]):  # only together
        with pytest.raises(SystemExit) as e:
            bs.main(["--shapes", "tiny", *argv])
        assert e.value.code == 2 and "go together" in capsys.readouterr().err

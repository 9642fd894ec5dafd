"""The seeds runner's own parts (benchmarks/seeds): the weight exchange round-trips exactly, a merged
state is loaded whole or refused, the code-tree check is git's tree id, a driver's failure comes
back as its last line; and, where the authors' code and venvs are set up, their code run end to
end on tiny models (skipped, with the reason, where they are not)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmarks.seeds import exchange, run
from symgraph.testing import models


def tiny_bert(seed=0):
    return models.build("bert", seed=seed, vocab=64, hidden=16, layers=1, heads=2, mlp=24, positions=16)


def test_state_round_trips_bit_exact_with_dtypes_and_tied_tensors(tmp_path):
    m = tiny_bert()
    state = dict(m.state_dict())
    state["half"] = torch.randn(3, 5).to(torch.bfloat16)
    state["index"] = torch.arange(7)
    tied = [k for k in state if k.endswith("decoder.weight")]
    assert tied and state[tied[0]].data_ptr() == m.bert.embeddings.word_embeddings.weight.data_ptr()
    exchange.save_state(tmp_path / "s.safetensors", state)
    back = exchange.load_state(tmp_path / "s.safetensors")
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def saved(m, tmp_path):
    """``m``'s checkpoint state as ``save_pretrained`` writes it (the names older versions read)."""
    m.save_pretrained(tmp_path / "m")
    return exchange.load_state(tmp_path / "m" / "model.safetensors")


def test_load_merged_takes_a_complete_state_and_leaves_the_template(tmp_path):
    a, b = tiny_bert(0), tiny_bert(1)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    out = exchange.load_merged(a, saved(b, tmp_path))
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in out.state_dict().items())
    assert all(torch.equal(v, before[k]) for k, v in a.state_dict().items())
    x = torch.randint(0, 64, (2, 8))
    assert torch.equal(out(input_ids=x).logits, b(input_ids=x).logits)


def test_load_merged_unties_the_decoder_when_asked(tmp_path):
    a, b = tiny_bert(0), tiny_bert(1)
    state = saved(b, tmp_path)
    dec = torch.randn_like(state["bert.embeddings.word_embeddings.weight"])
    untied = {"cls.predictions.decoder.weight": dec, "cls.predictions.decoder.bias": state["cls.predictions.bias"]}
    out = exchange.load_merged(a, {**state, **untied}, list(untied))
    assert torch.equal(out.cls.predictions.decoder.weight, dec)
    assert torch.equal(out.bert.embeddings.word_embeddings.weight, state["bert.embeddings.word_embeddings.weight"])
    assert a.config.tie_word_embeddings  # the template's config is not changed


@pytest.mark.parametrize("change", ["drop", "extra", "shape"])
def test_load_merged_refuses_what_does_not_fit(change, tmp_path):
    a = tiny_bert()
    state = saved(a, tmp_path)
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    if change == "drop":
        del state[name]
    elif change == "extra":
        state["not.a.weight"] = torch.zeros(1)
    else:
        state[name] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="does not fit the model"):
        exchange.load_merged(a, state)


def test_job_directory_holds_the_parents_batches_and_reference(tmp_path):
    a, b = tiny_bert(0), tiny_bert(1)
    ids = torch.randint(0, 64, (4, 8))
    d = exchange.write_job(tmp_path / "job", {"a": a, "b": b}, {"input_ids": ids}, {"a": torch.ones(2)},
                           {"reference_rows": 2})
    assert torch.equal(exchange.load_state(d / "batches.safetensors")["input_ids"], ids)
    got = exchange.load_state(d / "b" / "model.safetensors")
    assert got and all(torch.equal(v, b.state_dict()[k]) for k, v in got.items())
    import json
    assert json.loads((d / "a" / "config.json").read_text())["hidden_size"] == 16
    assert json.loads((d / exchange.JOB).read_text()) == {"models": ["a", "b"], "reference_rows": 2}
    with pytest.raises(exchange.Failed, match="wrote no"):
        exchange.read_output(d)


def test_read_output_gives_each_variant_the_state_with_its_entries_swapped(tmp_path):
    state = {"w": torch.ones(2, 2), "v": torch.zeros(3)}
    exchange.save_state(tmp_path / "out.safetensors", state)
    exchange.save_state(tmp_path / "variant_other.safetensors", {"w": torch.full((2, 2), 7.0)})
    import json
    (tmp_path / exchange.OUT).write_text(json.dumps({"variants": {"other": "w set to 7"}}))
    info, got, variants = exchange.read_output(tmp_path)
    assert info["variants"] == {"other": "w set to 7"} and torch.equal(got["w"], state["w"])
    assert set(variants) == {"other"} and torch.equal(variants["other"]["w"], torch.full((2, 2), 7.0))
    assert torch.equal(variants["other"]["v"], state["v"])
    exchange.save_state(tmp_path / "variant_other.safetensors", {"u": torch.ones(1)})
    with pytest.raises(exchange.Failed, match="lacks"):
        exchange.read_output(tmp_path)


def test_code_tree_is_the_commits_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    (repo / "sub" / "b.txt").write_text("b\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    want = subprocess.run([*git, "rev-parse", "HEAD^{tree}"], capture_output=True, text=True).stdout.strip()
    import shutil
    shutil.rmtree(repo / ".git")
    assert exchange.code_tree(repo) == want
    (repo / "a.py").write_text("x = 2\n")  # an edited file is another tree
    assert exchange.code_tree(repo) != want


def test_run_driver_reports_the_last_line_and_the_timeout(tmp_path):
    script = tmp_path / "drive.py"
    script.write_text("import sys, time\nif '--job' not in sys.argv: sys.exit(3)\n"
                      "print('working', file=sys.stderr)\n"
                      "if sys.argv[-1].endswith('slow'): time.sleep(30)\n"
                      "if sys.argv[-1].endswith('bad'): raise KeyError('q_proj')\n")
    assert "working" in exchange.run_driver(sys.executable, script, tmp_path, tmp_path / "ok", 60)
    with pytest.raises(exchange.Failed, match=r"^KeyError: 'q_proj'$"):
        exchange.run_driver(sys.executable, script, tmp_path, tmp_path / "bad", 60)
    with pytest.raises(exchange.Failed, match="did not finish in 1 s"):
        exchange.run_driver(sys.executable, script, tmp_path, tmp_path / "slow", 1)


def test_every_seed_is_pinned_and_names_its_driver():
    for s in run.SEEDS.values():
        assert len(s.commit) == 40 and len(s.tree) == 40
        assert (run.HERE / s.driver).is_file()
        assert all("==" in r for r in s.requirements)
        from benchmarks.methods import METHODS
        assert s.ours in METHODS


def _set_up(name):
    code, python = run.places(run.SEEDS[name], run.root_dir())
    if not (code.is_dir() and python.is_file()):
        pytest.skip(f"the authors' code or venv for {name} is not set up under the seeds root "
                    f"(python -m benchmarks seeds --setup)")


def test_verma_code_recovers_a_permuted_copy_end_to_end():
    """Their merge of A with a copy of A whose first MLP units are permuted is A again."""
    _set_up("verma")
    from benchmarks import evaluate, zoo
    a = zoo.build_model("bert", 0, "quick")
    b = tiny_copy_with_permuted_mlp(a)
    batches = evaluate.eval_batches("bert", "train", 1)
    parents = {"loss_a": evaluate.eval_loss(a, "bert", max_batches=1), "loss_b": 0.0}
    rows, info = run.theirs(run.SEEDS["verma"], run.root_dir(), a, b, batches, parents, 600)
    assert info["status"] == "ran", rows[0].get("error")
    assert [r["method"] for r in rows] == ["verma2024", "verma2024 (decoder_restored)"]
    assert info["untied"] == ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    assert info["sequences"] == 32
    assert max(info["parent_logit_diff"].values()) < 1e-3
    for row in rows:  # the residual stream is not permuted here: U is the identity, both decoders agree
        assert row["loss_mid"] == pytest.approx(evaluate.eval_loss(a, "bert"), abs=1e-3)
    assert max(info["b_transformed_logit_diff"].values()) < 1e-3


def tiny_copy_with_permuted_mlp(a):
    import copy
    b = copy.deepcopy(a)
    layer = b.bert.encoder.layer[0]
    perm = torch.randperm(layer.intermediate.dense.out_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.intermediate.dense.weight.copy_(layer.intermediate.dense.weight[perm])
        layer.intermediate.dense.bias.copy_(layer.intermediate.dense.bias[perm])
        layer.output.dense.weight.copy_(layer.output.dense.weight[:, perm])
    return b


def test_imfeld_code_fuses_the_vit_pair_end_to_end():
    """Their fusion runs on our ViTs with their published config and the images we give."""
    _set_up("imfeld")
    from benchmarks import evaluate, zoo
    a, b = zoo.build_model("vit", 0, "quick"), zoo.build_model("vit", 1, "quick")
    batches = evaluate.eval_batches("vit", "train", 1)
    parents = {"loss_a": 0.0, "loss_b": 0.0}
    rows, info = run.theirs(run.SEEDS["imfeld"], run.root_dir(), a, b, batches, parents, 600)
    assert info["status"] == "ran", rows[0].get("error")
    assert len(rows) == 1
    row = rows[0]
    assert info["images"] == 32 and info["fusion"]["acts"]["num_samples"] == 32
    assert info["fusion"]["ot_solver"] == "sinkhorn" and info["fusion"]["sinkhorn_reg"] == 0.08
    assert info["fusion"]["resid_policy"] == "mean"
    assert max(info["parent_logit_diff"].values()) < 1e-3
    assert torch.isfinite(torch.tensor(row["loss_mid"]))


def rotated_heads_copy(a, seed=0):
    """``a`` with every layer's heads rotated (one random orthogonal per head for Q/K, another for
    V/O) and the first layer's MLP units permuted: the same function in other coordinates."""
    import copy
    b, g = copy.deepcopy(a), torch.Generator().manual_seed(seed)
    heads = a.config.num_attention_heads
    d = a.config.hidden_size // heads
    with torch.no_grad():
        for layer in b.bert.encoder.layer:
            att = layer.attention
            for h in range(heads):
                rows = slice(h * d, (h + 1) * d)
                r_qk, r_vo = (torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(2))
                for lin, r in ((att.self.query, r_qk), (att.self.key, r_qk), (att.self.value, r_vo)):
                    lin.weight[rows] = r @ lin.weight[rows]
                    lin.bias[rows] = r @ lin.bias[rows]
                att.output.dense.weight[:, rows] = att.output.dense.weight[:, rows] @ r_vo.T
    return tiny_copy_with_permuted_mlp(b)


def test_zhang_code_recovers_a_rotated_copy_end_to_end():
    """Their merge of A with a copy of A in other coordinates (heads rotated, MLP units permuted)
    is A again, as published and in both per-head variants; the patterns matched every layer."""
    _set_up("zhang")
    from benchmarks import evaluate, zoo
    a = zoo.build_model("bert", 0, "quick")
    b = rotated_heads_copy(a)
    x = torch.randint(0, 64, (2, 16))
    assert torch.allclose(b(input_ids=x).logits, a(input_ids=x).logits, atol=1e-4)  # the copy is A
    assert not torch.allclose(b.bert.encoder.layer[1].attention.self.query.weight,
                              a.bert.encoder.layer[1].attention.self.query.weight, atol=1e-3)
    batches = evaluate.eval_batches("bert", "train", 1)
    loss_a = evaluate.eval_loss(a, "bert")
    rows, info = run.theirs(run.SEEDS["zhang"], run.root_dir(), a, b, batches, {"loss_a": loss_a, "loss_b": loss_a}, 600)
    assert info["status"] == "ran", rows[0].get("error")
    assert [r["method"] for r in rows] == ["zhang2025", "zhang2025 (per_head)", "zhang2025 (per_head_rescale)"]
    assert info["patterns_matched"] == {"attn_patterns.pattern0": 2, "ffn_patterns.pattern0": 2}
    assert info["transformers"] == "4.20.1" and info["anchor"] == "a"
    assert max(info["parent_logit_diff"].values()) < 1e-3
    assert max(info["b_transformed_logit_diff"].values()) < 1e-4
    for row in rows:
        assert row["loss_mid"] == pytest.approx(loss_a, abs=1e-4), row["method"]


def test_zhang_code_as_published_rotates_across_our_heads():
    """On our 16-wide heads their pi_merger's 64-row blocks (their helpers' default) change B's
    function; their later per-head helpers, given our heads, keep it; their BERT helpers given
    our head size stop at their own shape error."""
    _set_up("zhang")
    from benchmarks import evaluate, zoo
    a, b = zoo.build_model("bert", 0, "quick"), zoo.build_model("bert", 1, "quick")
    with torch.no_grad():  # peaked attention and logits of order one (still a model B)
        b.bert.embeddings.word_embeddings.weight.mul_(50.0)
        for layer in b.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(20.0)
    batches = evaluate.eval_batches("bert", "train", 1)
    rows, info = run.theirs(run.SEEDS["zhang"], run.root_dir(), a, b, batches, {"loss_a": 0.0, "loss_b": 0.0}, 600)
    assert info["status"] == "ran", rows[0].get("error")
    check = info["b_transformed_logit_diff"]
    assert check["pi_merger (as published: blocks of 64 rows)"] > 1e-2
    assert check["per_head"] < 1e-4 and check["per_head_rescale"] < 1e-4
    assert info["heads"] == 4 and info["head_size"] == 16 and info["their_block_rows"] == 64
    assert info["bert_helpers_at_our_head_size"].startswith("RuntimeError: The size of tensor a (16)")
    assert all(torch.isfinite(torch.tensor(r["loss_mid"])) for r in rows)

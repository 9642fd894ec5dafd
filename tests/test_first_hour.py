"""A user's first hour (issue 62), through the ``symgraph`` command in this process: a typo in a
local path or a hub that cannot be reached fails at once in one line; ``--version``; ``merge -h``
says what ``--no-fold-norms`` does; a depth mismatch is named as a user would; every command
writes a record of its own name; the model card reproduces the actual ``out:`` and inputs; data
no step reads is said and recorded as null; the output is sharded like the input
(``--max-shard-size`` to choose)."""
from __future__ import annotations

import json
import math
import os
import re
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from cli_helpers import main_in_process


def qwen2(layers: int, seed: int, path, shard: str | None = None):
    """A tiny Qwen2 (the issue's newcomer models), saved in bf16, sharded when ``shard`` says."""
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    (root / "work").mkdir()
    qwen2(3, 0, root / "qa", shard="20KB")
    qwen2(3, 1, root / "qb", shard="20KB")
    qwen2(4, 1, root / "deep")
    ids = torch.randint(0, 64, (40, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(root / "data.safetensors"))
    return root


def cli(ws, capsys, *args, seconds=120):
    """``(returncode, stdout, stderr)`` of ``symgraph ARGS`` run from ``ws/work``."""
    r = main_in_process(ws, *args, capsys=capsys, seconds=seconds)
    return r.returncode, r.stderr


def one_line(rc, err, *needles):
    assert rc == 2, err
    assert err.count("symgraph:") == 1 and "Traceback" not in err, err
    flat = " ".join(err.split())
    for n in needles:
        assert n in flat, (n, flat)


@pytest.mark.parametrize("args, name", [(["merge", "qa", "qx", "--out", "o"], "qa"), (["analyze", "qx"], "qx"),
                                        (["compare", "../qa", "qx"], "qx")])
def test_a_typo_in_a_local_path_fails_at_once(ws, capsys, args, name):
    t0 = time.perf_counter()
    rc, err = cli(ws, capsys, *args)
    took = time.perf_counter() - t0
    one_line(rc, err, f"no model directory {name!r} here", "owner/name hub id", "save_pretrained directory")
    assert took < 3, took
    assert not os.path.exists(ws / "work" / "o")


def test_an_unreachable_hub_fails_at_once_without_its_client_noise(ws, capsys, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    t0 = time.perf_counter()
    rc, err = cli(ws, capsys, "analyze", "nobody/nothing")
    took = time.perf_counter() - t0
    one_line(rc, err, "no model directory 'nobody/nothing' here", "http://127.0.0.1:9 cannot be reached",
             "not in the local hub cache")
    assert "Retry" not in err and "huggingface.co" not in err
    assert took < 3, took


def test_offline_hub_id_fails_in_one_line(ws, capsys, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rc, err = cli(ws, capsys, "merge", "nobody/nothing", "../qa", "--out", "o")
    one_line(rc, err, "'nobody/nothing'", "offline: HF_HUB_OFFLINE is set")


def test_version(capsys):
    from symgraph._version import __version__
    from symgraph.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"symgraph {__version__}"


def test_merge_help_says_no_fold_norms_switches_folding_off(capsys):
    from symgraph.cli.main import main
    with pytest.raises(SystemExit):
        main(["merge", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("--no-fold-norms "):]
    assert text.startswith("--no-fold-norms switch off the default: fold norm gains"), text[:120]
    assert "--max-shard-size SIZE" in out


def test_a_depth_mismatch_is_named_by_its_layer_count(ws, capsys):
    rc, err = cli(ws, capsys, "merge", "../qa", "../deep", "--out", "o")
    one_line(rc, err, "'num_hidden_layers' (3 vs 4", "one depth")
    assert "differ in config field 'layer_types'" not in err


def test_merge_card_record_shards_and_unused_data(ws, capsys):
    rc, err = cli(ws, capsys, "merge", "../qa", "../qb", "--data", "../data.safetensors", "--out", "m")
    assert rc == 0, err
    assert err.count("symgraph: warning") == 1 and "used by no step of this merge" in err, err
    out = ws / "work" / "m"
    rec = json.loads((out / "symgraph_merge.json").read_text())
    assert rec["options"]["data"] is None and rec["options"]["data_batches"] == 0
    card = (out / "README.md").read_text()
    assert f"out: {out}\n" in card and "out: merged" not in card
    assert f"- {ws / 'qa'}\n" in card and "data:" not in card
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(p.name for p in (ws / "qa").glob("*.safetensors")) and len(shards) == 3
    rc, err = cli(ws, capsys, "merge", "../qa", "../qb", "--align", "none", "--max-shard-size", "1GB",
                  "--out", "one")
    assert rc == 0, err
    assert sorted(p.name for p in (ws / "work" / "one").glob("*.safetensors")) == ["model.safetensors"]
    rc, err = cli(ws, capsys, "merge", "../qa", "../qb", "--max-shard-size", "big", "--out", "bad")
    one_line(rc, err, "--max-shard-size", "'2GB'")


@pytest.mark.slow
def test_each_command_writes_a_record_of_its_own_name(ws, capsys):
    runs = {"compare": ["compare", "../qa", "../qb", "--null", "2", "--out", "c"],
            "barrier": ["barrier", "../qa", "../qb", "--data", "../data.safetensors", "--points", "3",
                        "--align", "none", "--out", "b"],
            "align": ["align", "../qa", "../qb", "--out", "a"]}
    for name, args in runs.items():
        rc, err = cli(ws, capsys, *args, seconds=300)
        assert rc == 0, (name, err)
        out = ws / "work" / args[-1]
        files = {p.name for p in out.iterdir()}
        assert f"symgraph_{name}.json" in files and "symgraph_merge.json" not in files, (name, files)
        rec = json.loads((out / f"symgraph_{name}.json").read_text())
        assert f"symgraph_{name}.json" in rec["files"]
    # a previous output of any command is recognised as symgraph's: --force replaces it
    rc, err = cli(ws, capsys, *runs["compare"], "--force")
    assert rc == 0, err


def test_a_width_change_is_said_on_stdout_in_the_record_and_the_card(tmp_path, capsys):
    from symgraph.cli.main import main
    from symgraph.testing import models
    sizes = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, positions=64)
    models.build("llama", seed=0, mlp=48, **sizes).save_pretrained(tmp_path / "a")
    models.build("llama", seed=1, mlp=64, **sizes).save_pretrained(tmp_path / "b")
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o")]) == 0
    said = f"'{tmp_path / 'b'}': intermediate_size 64 -> 48"
    assert f"widths differ, transported into the anchor's ({said})" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "symgraph_merge.json").read_text())["width_change"] == [said]
    assert f"- width change: {said}" in (tmp_path / "o" / "README.md").read_text()
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "same")]) == 0
    assert "widths differ" not in capsys.readouterr().out
    assert json.loads((tmp_path / "same" / "symgraph_merge.json").read_text())["width_change"] == []


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from symgraph.testing import models
    root = tmp_path_factory.mktemp("progress")
    sizes = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
    for seed in (0, 1):
        models.build("llama", seed=seed, **sizes).save_pretrained(root / "ab"[seed])
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(root / "data.safetensors"))
    return root


PROGRESS = [
    (["merge", "{a}", "{b}", "--out", "{o}"], ["aligning: sweep 1", "aligning: sweep 2", "writing"]),
    (["merge", "{a}", "{b}", "--align", "activations", "--method", "regmean", "--repair", "--data", "{d}",
      "--out", "{o}"], ["activation statistics (pass 1 of", "statistics:", "REPAIR", "writing"]),
    (["barrier", "{a}", "{b}", "--data", "{d}", "--align", "none", "--points", "3"], ["barrier:", "0/3 [", "point/s"]),
    (["compare", "{a}", "{b}", "--null", "2"], ["null (shuffled copies of B):", "0/2 [", "draw/s"]),
]


@pytest.mark.parametrize("args, bars", PROGRESS, ids=["merge", "statistics", "barrier", "compare"])
@pytest.mark.slow
def test_progress_bars_show_when_forced_and_never_with_quiet(pair, tmp_path, capsys, monkeypatch, args, bars):
    from symgraph.cli.main import main
    fill = dict(a=pair / "a", b=pair / "b", d=pair / "data.safetensors")
    argv = [x.format(o=tmp_path / "forced", **fill) for x in args]
    monkeypatch.setenv("SYMGRAPH_PROGRESS", "1")  # as if stderr were a terminal
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    for b in bars:
        assert b in err, (b, err[-2000:])
    argv = [x.format(o=tmp_path / "quiet", **fill) for x in args]
    assert main(["--quiet", *argv]) == 0 and capsys.readouterr().err == ""
    monkeypatch.delenv("SYMGRAPH_PROGRESS")  # stderr is not a terminal here: no bars either
    argv = [x.format(o=tmp_path / "plain", **fill) for x in args]
    assert main(argv) == 0 and capsys.readouterr().err == ""


def test_quiet_is_taken_before_or_after_the_subcommand():
    from symgraph.cli.main import build_parser
    p = build_parser()
    assert p.parse_args(["--quiet", "compare", "a", "b"]).quiet
    assert p.parse_args(["compare", "a", "b", "--quiet"]).quiet
    assert not p.parse_args(["compare", "a", "b"]).quiet


@pytest.mark.slow
def test_the_newcomer_job(ws, capsys):
    """The issue's first hour on tiny models: two Qwen2-style sharded bf16 checkpoints, a padded
    data file with its mask, merged by weights and by activations, then barrier and compare."""
    ids = torch.randint(1, 64, (32, 10), generator=torch.Generator().manual_seed(1))
    lengths = 6 + torch.arange(32) % 5  # 6..10 tokens, right-padded with 0 to 10
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    save_file({"input_ids": ids * mask, "attention_mask": mask}, str(ws / "padded.safetensors"))
    runs = [["merge", "../qa", "../qb", "--out", "job_w"],
            ["merge", "../qa", "../qb", "--align", "activations", "--data", "../padded.safetensors", "--out", "job_a"],
            ["barrier", "../qa", "../qb", "--data", "../padded.safetensors", "--points", "3", "--out", "job_b"],
            ["compare", "../qa", "../qb", "--data", "../padded.safetensors", "--null", "2", "--out", "job_c"]]
    for args in runs:
        rc, err = cli(ws, capsys, *args, seconds=600)
        assert rc == 0 and "Traceback" not in err, (args, err)
    for name in ("job_w", "job_a"):
        out = ws / "work" / name
        assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
        tensors = {}
        for f in out.glob("*.safetensors"):
            tensors.update(load_file(str(f)))
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        assert all(torch.isfinite(t.float()).all() for t in tensors.values())
    rec = json.loads((ws / "work" / "job_a" / "symgraph_merge.json").read_text())
    assert rec["options"]["data"] == str(ws / "padded.safetensors") and rec["options"]["data_batches"] == 5
    rows = json.loads((ws / "work" / "job_b" / "barrier.json").read_text())["rows"]
    assert {r["align"] for r in rows} >= {"none", "weights"}
    assert all(math.isfinite(loss) for r in rows for _, loss in r["curve"])
    verdict = json.loads((ws / "work" / "job_c" / "compare.json").read_text())["verdict"]
    assert verdict in ("unrelated", "derived")  # two independent seeds: never "same"


def test_a_budget_learned_matching_cannot_fit_is_refused_before_any_alignment(pair, tmp_path, capsys, monkeypatch):
    from symgraph.alignment import driver
    from symgraph.merging import learned, streaming

    def never(*a, **k):
        raise AssertionError("aligned before the budget was checked")
    args = ["merge", str(pair / "a"), str(pair / "b"), "--refine", "2", "--data", str(pair / "data.safetensors")]
    with monkeypatch.context() as m:
        for mod in (driver, learned, streaming):
            if hasattr(mod, "align_tensors"):
                m.setattr(mod, "align_tensors", never)
        t0 = time.perf_counter()
        r = main_in_process(tmp_path, *args, "--memory-budget", "100KB", "--out", "o", capsys=capsys, cwd=".")
        took = time.perf_counter() - t0
    one_line(r.returncode, r.stderr, "learned matching holds", "over half the memory budget (100 kB)",
             "(the smallest that works)")
    assert took < 20, took
    need = re.search(r"at least ([\d.]+ [kMG]?B)", " ".join(r.stderr.split())).group(1)
    assert not (tmp_path / "o").exists()
    r = main_in_process(tmp_path, *args, "--memory-budget", need.replace(" ", ""), "--out", "o", capsys=capsys,
                        cwd=".", seconds=300)
    assert r.returncode == 0, r.stderr


def test_a_checkpoint_named_twice_is_merged_with_a_warning(ws, capsys):
    """The same directory named twice (here through a trailing slash) is weighed twice, as
    mergekit does, and said once: a user who meant two models learns it before the merge."""
    rc, err = cli(ws, capsys, "merge", "../qa", "../qa/", "--align", "none", "--out", "twice")
    assert rc == 0, err
    assert err.count("symgraph: warning") == 1, err
    assert "models[1] ('../qa/') is the checkpoint models[0] ('../qa') names again" in " ".join(err.split())
    merged = load_file(str(next((ws / "work" / "twice").glob("*.safetensors"))))
    original = {}
    for f in (ws / "qa").glob("*.safetensors"):
        original.update(load_file(str(f)))
    assert all(torch.equal(t, original[k]) for k, t in merged.items())  # A/2 + A/2 is A, bit for bit in bf16


def test_a_model_beside_itself_is_no_merge_and_gets_no_merge_warning(ws, capsys):
    rc, err = cli(ws, capsys, "align", "../qa", "../qa/", "--out", "self_aligned")
    assert rc == 0 and "warning" not in err and "weighs it twice" not in err, err

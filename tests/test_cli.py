"""The ``symgraph`` command, driven as a subprocess on tiny checkpoints saved to tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import CLI_ENV as ENV
from conftest import cli
from cli_helpers import digest


def bert(seed):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    return transformers.BertForMaskedLM(cfg)


def gpt2(seed):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    bert(0).save_pretrained(d / "bert0")
    bert(1).save_pretrained(d / "bert1")
    (d / "bert0" / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(100)))
    gpt2(0).save_pretrained(d / "gpt0")
    nan = bert(2)
    with torch.no_grad():
        nan.bert.encoder.layer[1].output.dense.weight[0, 0] = float("nan")
    nan.save_pretrained(d / "bertnan")
    (d / "empty").mkdir()
    (d / "noweights").mkdir()
    bert(0).config.save_pretrained(d / "noweights")
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 100, (16, 8), generator=g)}, str(d / "data.safetensors"))
    save_file({"input_ids": torch.randint(0, 100, (16, 8, 2), generator=g)}, str(d / "bad3d.safetensors"))
    return d


# --- analyze -------------------------------------------------------------------------------


@pytest.mark.slow
def test_analyze_table_and_dot(ckpts, tmp_path):
    r = cli("analyze", ckpts / "bert0", "--dot", tmp_path / "g.dot")
    assert r.returncode == 0, r.stderr
    assert "Symmetry report for BertForMaskedLM" in r.stdout
    assert "bert.encoder.layer.1" in r.stdout and "perm" in r.stdout
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


@pytest.mark.slow
def test_analyze_json(ckpts):
    r = cli("analyze", ckpts / "gpt0", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # stdout is only JSON
    assert d["model"] == "GPT2LMHeadModel"
    assert len(d["groups"]) > 0 and {"kind", "size"} <= set(d["groups"][0])


# --- merge ---------------------------------------------------------------------------------


def _check_merged(out, inputs):
    m = transformers.AutoModelForMaskedLM.from_pretrained(out)
    x = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        logits = m(input_ids=x).logits
    assert logits.shape == (2, 8, 100) and torch.isfinite(logits).all()
    meta = json.loads((out / "symgraph_merge.json").read_text())
    assert meta["inputs"] == [str(p) for p in inputs]
    return meta


def test_merge_two_checkpoints(ckpts, tmp_path):
    before = digest(ckpts)
    out = tmp_path / "merged"
    r = cli("merge", ckpts / "bert0", ckpts / "bert1", "--out", out, "--weights", "1", "3")
    assert r.returncode == 0, r.stderr
    meta = _check_merged(out, [ckpts / "bert0", ckpts / "bert1"])
    assert meta["options"]["align"] == "weights" and meta["options"]["weights"] == [1.0, 3.0]
    assert meta["alignments"] and meta["alignments"][0]["groups"]
    assert (out / "vocab.txt").read_text() == (ckpts / "bert0" / "vocab.txt").read_text()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temp dir left behind
    assert digest(ckpts) == before


@pytest.mark.slow
def test_merge_yaml_config(ckpts, tmp_path):
    out = tmp_path / "ymerged"
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(f"models:\n  - {ckpts / 'bert0'}\n  - {ckpts / 'bert1'}\nout: ymerged\n"
                   f"align: activations\nmethod: regmean\ndata: {ckpts / 'data.safetensors'}\n"
                   "outputs: [logits]\n")
    r = cli("merge", "--config", cfg)
    assert r.returncode == 0, r.stderr
    meta = _check_merged(out, [ckpts / "bert0", ckpts / "bert1"])
    assert meta["options"]["method"] == "regmean" and meta["options"]["data_batches"] == 2
    assert meta["options"]["outputs"] == ["logits"]


# --- refusals ------------------------------------------------------------------------------


def refused(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())  # the paragraph is wrapped
    for n in needles:
        assert n in err, (n, r.stderr)


@pytest.mark.parametrize("case", ["different_arch", "nan", "missing", "empty_dir", "no_weights",
                                  "bad_data", "out_exists", "yaml_bad_key", "yaml_bad_type",
                                  "bad_output", "yaml_bad_output"])
@pytest.mark.slow
def test_merge_refusals(ckpts, tmp_path, case):
    before = digest(ckpts)
    out = tmp_path / "out"
    b0, b1 = ckpts / "bert0", ckpts / "bert1"
    if case == "different_arch":
        r = cli("merge", b0, ckpts / "gpt0", "--out", out)
        refused(r, "is a BertForMaskedLM but", "is a GPT2LMHeadModel", "expected models of one architecture")
    elif case == "nan":
        r = cli("merge", b0, ckpts / "bertnan", "--out", out)
        refused(r, "NaN", "bert.encoder.layer.1.output.dense.weight")
    elif case == "missing":
        r = cli("merge", b0, tmp_path / "nowhere", "--out", out)
        refused(r, "does not exist", "nowhere")
    elif case == "empty_dir":
        r = cli("merge", b0, ckpts / "empty", "--out", out)
        refused(r, "config.json", "model.safetensors")
    elif case == "no_weights":
        r = cli("merge", b0, ckpts / "noweights", "--out", out)
        refused(r, "no model.safetensors")
    elif case == "bad_data":
        r = cli("merge", b0, b1, "--out", out, "--align", "activations", "--data",
                ckpts / "bad3d.safetensors")
        refused(r, "input_ids", "(16, 8, 2)", "[N, S]")
    elif case == "out_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        r = cli("merge", b0, b1, "--out", out)
        refused(r, "already exists", "--force")
        assert os.listdir(out) == ["keep.txt"]
        return
    elif case == "yaml_bad_key":
        (tmp_path / "m.yaml").write_text(f"models: [{b0}, {b1}]\nout: {out}\nalignment: weights\n")
        r = cli("merge", "--config", tmp_path / "m.yaml")
        refused(r, "'alignment'", "expected only")
    elif case == "bad_output":  # out of core, and in memory (activations)
        refused(cli("merge", b0, b1, "--out", out, "--outputs", "logitz"), "'logitz'", "logits")
        r = cli("merge", b0, b1, "--out", out, "--outputs", "logitz", "--align", "activations",
                "--data", ckpts / "data.safetensors")
        refused(r, "'logitz'", "logits")
    elif case == "yaml_bad_output":
        (tmp_path / "m.yaml").write_text(f"models: [{b0}, {b1}]\nout: {out}\noutputs: logits\n")
        refused(cli("merge", "--config", tmp_path / "m.yaml"), "'outputs'", "a list of output names")
    elif case == "yaml_bad_type":
        (tmp_path / "m.yaml").write_text(f"models: [{b0}, {b1}]\nout: {out}\nweights: 0.5\n")
        r = cli("merge", "--config", tmp_path / "m.yaml")
        refused(r, "'weights'", "a list of numbers")
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    assert digest(ckpts) == before


@pytest.mark.slow
def test_analyze_refusals(ckpts, tmp_path):
    refused(cli("analyze", tmp_path / "nowhere"), "does not exist")
    # an untraceable model: the CLI turns the TraceError into a refusal with a hint
    code = ("import sys, symgraph, symgraph.report.api, symgraph.cli.main as c\n"
            "def boom(*a, **k): raise symgraph.TraceError('torch.export failed at data-dependent branch')\n"
            "symgraph.report.api.trace = boom\n"
            f"sys.exit(c.main(['analyze', {str(ckpts / 'bert0')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    refused(r, "data-dependent branch", "Hint")


def test_debug_shows_traceback(tmp_path):
    r = cli("--debug", "analyze", tmp_path / "nowhere")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.slow
def test_demo_smoke(tmp_path):
    env = {**ENV, "SYMGRAPH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "symgraph", "demo", "--out", str(tmp_path / "demo"),
                        "--seconds", "6"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "barrier" in r.stdout and "activations" in r.stdout
    assert (tmp_path / "demo" / "barrier.png").stat().st_size > 0
    assert os.path.isfile(tmp_path / "cache" / "demo-gpt2-char-v1" / "seed0" / "model.safetensors")


def test_a_closed_output_pipe_ends_quietly():
    """``symgraph analyze ... | head``: the reader gone is no bad input (not exit 2, no message)."""
    p = subprocess.Popen([sys.executable, "-m", "symgraph", "analyze", "tiny-llama"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV)
    p.stdout.close()  # before the command writes: its first write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and "Broken pipe" not in err and "Traceback" not in err, err

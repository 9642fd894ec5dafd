"""Hostile input through the ``symgraph`` command: every case must exit with its code, say
what was wrong and what was expected in one paragraph (no traceback), and leave every file
outside ``--out`` exactly as it was (the whole tree is hashed before and after)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from cli_helpers import ENV, digest
from test_cli import bert, gpt2


def llama(seed, head_dim=8):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, head_dim=head_dim,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    return transformers.LlamaForCausalLM(cfg)


def _bert_cfg(**kw):
    base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=32)
    return transformers.BertConfig(**(base | kw))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: inputs (good and bad checkpoints, data), a working directory, a user file."""
    root = tmp_path_factory.mktemp("ws")
    inp, work = root / "inputs", root / "work"
    work.mkdir()
    (root / "notes.txt").write_text("the user's own file")
    (work / "todo.txt").write_text("also the user's")
    for s in (0, 1):
        bert(s).save_pretrained(inp / f"bert{s}")
    gpt2(0).save_pretrained(inp / "gpt0")
    llama(0).save_pretrained(inp / "llama0")
    llama(1, head_dim=16).save_pretrained(inp / "llama_hd16")
    torch.manual_seed(3)
    transformers.BertForMaskedLM(_bert_cfg(vocab_size=120)).save_pretrained(inp / "bert_vocab120")
    transformers.BertForMaskedLM(_bert_cfg(num_hidden_layers=3)).save_pretrained(inp / "bert_deep")
    transformers.BertForMaskedLM(_bert_cfg(intermediate_size=96)).save_pretrained(inp / "bert_wide")
    st = inp / "bert0" / "model.safetensors"
    sd = load_file(str(st))
    for name, edit in {
        "missing_tensor": lambda d: d.pop("bert.encoder.layer.1.output.dense.weight"),
        "extra_tensor": lambda d: d.__setitem__("bert.encoder.layer.9.extra.weight", torch.zeros(3)),
        "nan": lambda d: d["bert.encoder.layer.0.output.dense.weight"].__setitem__((0, 0), float("nan")),
    }.items():
        d = {k: v.clone() for k, v in sd.items()}
        edit(d)
        shutil.copytree(inp / "bert0", inp / name)
        save_file(d, str(inp / name / "model.safetensors"), metadata={"format": "pt"})
    raw = st.read_bytes()
    for name, content in {"corrupt": b"not a safetensors file at all", "truncated": raw[: len(raw) // 2],
                          "empty_file": b""}.items():
        shutil.copytree(inp / "bert0", inp / name)
        (inp / name / "model.safetensors").write_bytes(content)
    shutil.copytree(inp / "bert0", inp / "pickle")
    (inp / "pickle" / "model.safetensors").unlink()
    torch.save(sd, inp / "pickle" / "pytorch_model.bin")
    shutil.copytree(inp / "bert0", inp / "no_config")
    (inp / "no_config" / "config.json").unlink()
    shutil.copytree(inp / "bert0", inp / "bad_json")
    (inp / "bad_json" / "config.json").write_text("{not json")
    shutil.copytree(inp / "bert0", inp / "no_arch")
    cfg = json.loads((inp / "bert0" / "config.json").read_text())
    cfg.pop("architectures")
    (inp / "no_arch" / "config.json").write_text(json.dumps(cfg))
    (inp / "empty_dir").mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 100, (16, 8), generator=g)}, str(inp / "data.safetensors"))
    save_file({"input_ids": torch.randint(0, 100, (16, 8, 2), generator=g)}, str(inp / "bad3d.safetensors"))
    save_file({"input_ids": torch.randint(100, 200, (16, 8), generator=g)}, str(inp / "oov.safetensors"))
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("irreplaceable")
    return root


def run(ws, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True,
                          text=True, env=ENV, cwd=ws / "work", timeout=timeout)


def yaml_case(ws, name, body):
    p = ws / "inputs" / f"{name}.yaml"
    if not p.exists():
        p.write_text(body.format(i=ws / "inputs"))
    return ["merge", "--config", p]


I = "inputs"  # noqa: E741
# (case, argv builder, needles that the one-paragraph refusal must contain)
CASES = [
    ("missing_path", lambda w: ["merge", w / I / "bert0", w / I / "nowhere", "--out", w / "o"],
     ["does not exist", "nowhere"]),
    ("path_is_file", lambda w: ["merge", w / I / "bert0", w / "notes.txt", "--out", w / "o"],
     ["is a file", "save_pretrained"]),
    ("empty_dir", lambda w: ["merge", w / I / "bert0", w / I / "empty_dir", "--out", w / "o"],
     ["config.json", "model.safetensors"]),
    ("no_config", lambda w: ["merge", w / I / "bert0", w / I / "no_config", "--out", w / "o"],
     ["no config.json"]),
    ("bad_json_config", lambda w: ["merge", w / I / "bert0", w / I / "bad_json", "--out", w / "o"],
     ["cannot read", "config.json"]),
    ("no_architectures", lambda w: ["merge", w / I / "bert0", w / I / "no_arch", "--out", w / "o"],
     ["architectures"]),
    ("pickle_payload", lambda w: ["merge", w / I / "bert0", w / I / "pickle", "--out", w / "o"],
     ["pytorch_model.bin", "pickle", "expected model.safetensors"]),
    ("corrupt_safetensors", lambda w: ["merge", w / I / "bert0", w / I / "corrupt", "--out", w / "o"],
     ["corrupt", "safetensors"]),
    ("truncated_safetensors", lambda w: ["merge", w / I / "bert0", w / I / "truncated", "--out", w / "o"],
     ["truncated", "safetensors"]),
    ("empty_safetensors", lambda w: ["merge", w / I / "bert0", w / I / "empty_file", "--out", w / "o"],
     ["empty_file", "safetensors"]),
    ("nan_weights", lambda w: ["merge", w / I / "bert0", w / I / "nan", "--out", w / "o"],
     ["NaN", "bert.encoder.layer.0.output.dense.weight"]),
    ("missing_tensor", lambda w: ["merge", w / I / "bert0", w / I / "missing_tensor", "--out", w / "o"],
     ["bert.encoder.layer.1.output.dense.weight", "random initialisation"]),
    ("unused_tensor", lambda w: ["merge", w / I / "bert0", w / I / "extra_tensor", "--out", w / "o"],
     ["bert.encoder.layer.9.extra.weight", "not used"]),
    ("different_classes", lambda w: ["merge", w / I / "bert0", w / I / "gpt0", "--out", w / "o"],
     ["BertForMaskedLM", "GPT2LMHeadModel"]),
    ("vocab_mismatch", lambda w: ["merge", w / I / "bert0", w / I / "bert_vocab120", "--out", w / "o"],
     ["vocab_size 100 vs 120"]),
    ("depth_mismatch", lambda w: ["merge", w / I / "bert0", w / I / "bert_deep", "--out", w / "o"],
     ["num_hidden_layers 2 vs 3"]),
    ("depth_mismatch_align_none", lambda w: ["merge", w / I / "bert0", w / I / "bert_deep", "--align", "none",
                                             "--out", w / "o"], ["num_hidden_layers 2 vs 3"]),
    ("width_mismatch_align_none", lambda w: ["merge", w / I / "bert0", w / I / "bert_wide", "--align", "none",
                                             "--out", w / "o"], ["--align weights", "intermediate_size 64 vs 96"]),
    ("head_dim_mismatch", lambda w: ["merge", w / I / "llama0", w / I / "llama_hd16", "--out", w / "o"],
     ["head", "head_dim 8 vs 16"]),
    ("out_is_input", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", w / I / "bert1", "--force"],
     ["is an input model"]),
    ("out_is_ancestor_of_input", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", w / I,
                                            "--force"], ["contains it"]),
    ("out_is_cwd", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", ".", "--force"],
     ["current directory"]),
    ("out_is_foreign_dir", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", w / "foreign",
                                      "--force"], ["not written by symgraph", "--force"]),
    ("out_is_file", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", w / "notes.txt", "--force"],
     ["not a directory"]),
    ("out_unwritable", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", "/proc/symgraph-out"],
     ["cannot write into", "/proc"]),
    ("out_parent_missing", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--out", w / "no" / "o"],
     ["parent directory", "does not exist"]),
    ("weights_count", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--weights", "1", "--out", w / "o"],
     ["1 values for 2 models"]),
    ("weights_negative", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--weights", "1", "-2",
                                    "--out", w / "o"], ["non-negative"]),
    ("data_missing", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--align", "activations",
                                "--data", w / "nodata.safetensors", "--out", w / "o"], ["does not exist"]),
    ("data_3d", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--align", "activations",
                           "--data", w / I / "bad3d.safetensors", "--out", w / "o"], ["(16, 8, 2)", "[N, S]"]),
    ("data_out_of_vocab", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--align", "activations",
                                     "--data", w / I / "oov.safetensors", "--out", w / "o"], ["[0, 99]"]),
    ("activations_without_data", lambda w: ["merge", w / I / "bert0", w / I / "bert1", "--align",
                                            "activations", "--out", w / "o"], ["needs --data"]),
    ("yaml_unknown_key", lambda w: yaml_case(w, "unknown", "models: [{i}/bert0, {i}/bert1]\nout: o\nalignment: x\n"),
     ["'alignment'", "expected only"]),
    ("yaml_boolean_trap", lambda w: yaml_case(w, "booltrap", "models: [{i}/bert0, {i}/bert1]\nout: o\nalign: no\n"),
     ["'align'", "boolean", "'none' in quotes"]),
    ("yaml_not_mapping", lambda w: yaml_case(w, "list", "- {i}/bert0\n- {i}/bert1\n"), ["holds a list"]),
    ("yaml_syntax", lambda w: yaml_case(w, "syntax", "models: [unclosed\n"), ["not valid YAML"]),
    ("hub_name_offline", lambda w: ["merge", w / I / "bert0", "nobody/no-such-model", "--out", w / "o"],
     ["nobody/no-such-model", "offline"]),
]


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_refusal(ws, case, argv, needles):
    args = argv(ws)
    before = digest(ws)
    t0 = time.time()
    r = run(ws, *args)
    assert r.returncode == 2, (case, r.returncode, r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "\nsymgraph: " in "\n" + r.stderr, r.stderr
    err = " ".join(r.stderr.split())
    for n in needles:
        assert n in err, (case, n, err)
    assert digest(ws) == before  # nothing outside --out changed, nothing created
    if case == "hub_name_offline":
        assert time.time() - t0 < 30  # no network wait


@pytest.mark.slow
def test_sigterm_while_writing_leaves_nothing(ws):
    """SIGTERM while the output is half written (the temporary directory exists): exit 143, one
    line, no temporary directory, no output, nothing else touched."""
    before = digest(ws)
    code = ("import sys, time, transformers, symgraph.cli.main as c\n"
            "orig = transformers.PreTrainedModel.save_pretrained\n"
            "def slow(self, *a, **k):\n"
            "    orig(self, *a, **k); sys.stderr.write('SAVED\\n'); sys.stderr.flush(); time.sleep(120)\n"
            "transformers.PreTrainedModel.save_pretrained = slow\n"
            "import symgraph.merging.streaming as st\n"  # the out-of-core writer (a plain average)
            "orig_w = st.StreamingMerge.write\n"
            "def slow_w(self, *a, **k):\n"
            "    r = orig_w(self, *a, **k); sys.stderr.write('SAVED\\n'); sys.stderr.flush(); time.sleep(120)\n"
            "st.StreamingMerge.write = slow_w\n"
            f"sys.exit(c.main(['merge', {str(ws / I / 'bert0')!r}, {str(ws / I / 'bert1')!r}, "
            f"'--out', {str(ws / 'sig_out')!r}]))\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ws / "work", env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen, saved = [], threading.Event()

    def read():
        for line in iter(p.stderr.readline, ""):
            seen.append(line)
            if line.startswith("SAVED"):
                saved.set()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert saved.wait(150), "".join(seen)
    assert [f for f in os.listdir(ws) if f.startswith(".symgraph-tmp-")]  # caught mid-write
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    t.join(10)
    err = "".join(seen)
    assert p.returncode == 143, err
    assert "terminated" in err and "Traceback" not in err
    assert not (ws / "sig_out").exists()
    assert not [f for f in os.listdir(ws) if f.startswith(".")]  # the temporary directory is gone
    assert digest(ws) == before


@pytest.mark.slow
def test_bf16_sharded_round_trip_keeps_dtype(ws, tmp_path):
    """bf16 inputs saved in shards merge into bf16 output with a model card."""
    srcs = []
    for s in (0, 1):
        m = bert(s).to(torch.bfloat16)
        d = tmp_path / f"b{s}"
        m.save_pretrained(d, max_shard_size="20KB")
        assert (d / "model.safetensors.index.json").exists()
        srcs.append(d)
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "symgraph", "merge", *map(str, srcs), "--out", str(out)],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr
    m = transformers.BertForMaskedLM.from_pretrained(out)
    assert m.dtype == torch.bfloat16
    assert {v.dtype for v in load_file(str(next(out.glob("*.safetensors")))).values()} == {torch.bfloat16}
    card = (out / "README.md").read_text()
    assert "symgraph merge --config" in card and "align: weights" in card and "bfloat16" in card
    # --force replaces a previous symgraph output, and only that
    r = subprocess.run([sys.executable, "-m", "symgraph", "merge", *map(str, srcs), "--out", str(out),
                        "--force", "--align", "none"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "symgraph_merge.json").read_text())["options"]["align"] == "none"
    mode = os.stat(out).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask


ROUND_TRIP = {
    "neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32)),
    "swin": lambda: transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=3)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)),
}


@pytest.mark.parametrize("arch", list(ROUND_TRIP))
def test_save_pretrained_round_trip_is_exact(arch, tmp_path):
    """Checkpoints whose keys transformers renames on load (the old loader left them at random)."""
    from symgraph.checkpoints.specs import load_model
    torch.manual_seed(0)
    m = ROUND_TRIP[arch]().eval()
    m.save_pretrained(tmp_path / arch)
    got = load_model(str(tmp_path / arch))
    sa, sb = m.state_dict(), got.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.slow
def test_small_odd_sized_data_is_used_whole_with_a_warning(ws, tmp_path):
    g = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(0, 100, (11, 6), generator=g)}, str(tmp_path / "d.safetensors"))
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "symgraph", "merge", str(ws / I / "bert0"), str(ws / I / "bert1"),
                        "--align", "activations", "--data", str(tmp_path / "d.safetensors"), "--out", str(out)],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "warning: only 11 rows" in " ".join(r.stderr.split())
    meta = json.loads((out / "symgraph_merge.json").read_text())
    assert meta["options"]["data_batches"] == 2  # 8 + 3 rows: the odd batch is traced again, not dropped


@pytest.mark.slow  # the default suite took 747 s at 29a92d8 (budget 600 s); tests/test_families.py::test_bart_cross_attention_and_streams keeps encoder-decoder tracing
def test_encoder_decoder_is_traced_with_decoder_inputs(tmp_path):
    """T5 used to be refused as untraceable with a misleading hint."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    cfg.architectures = ["T5ForConditionalGeneration"]
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "t5")
    r = subprocess.run([sys.executable, "-m", "symgraph", "analyze", str(tmp_path / "t5"), "--json"],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"] == "T5ForConditionalGeneration" and len(d["groups"]) >= 10 and d["frozen"] == []


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """A Ctrl-C while the console script imports torch (simulated at the import of torch): the
    entry point, ``symgraph`` and ``symgraph.cli`` load without torch, so the script's ``try``
    is in place first."""
    code = ("import sys, symgraph.cli.entry as entry\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "entry.main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                       timeout=60)
    assert r.returncode == 130 and "Traceback" not in r.stderr
    assert r.stderr == "symgraph: interrupted (Ctrl-C) while starting; nothing was written\n"


def test_remove_own_deletes_only_what_it_created(tmp_path):
    """Deletion goes by identity: a directory or file put in place of the one symgraph made
    (same name, another inode) and a link are left alone."""
    from symgraph.checkpoints.outdir import identity, remove_own
    made = tmp_path / "made"
    made.mkdir()
    ident = identity(made)
    made.rename(tmp_path / "moved")  # still exists: the new directory gets another inode
    made.mkdir()  # someone else's directory under the same name
    (made / "keep").write_text("x")
    remove_own(str(made), ident, "made")
    assert (made / "keep").read_text() == "x"
    link = tmp_path / "link"
    link.symlink_to(made)
    remove_own(str(link), identity(link), "link")
    assert link.is_symlink() and (made / "keep").exists()  # a link is never followed nor removed
    f = tmp_path / "f"
    f.write_text("y")
    remove_own(str(f), identity(f), "f")
    remove_own(str(made), identity(made), "made")
    remove_own(str(tmp_path / "moved"), ident, "moved")
    assert not f.exists() and not made.exists() and not (tmp_path / "moved").exists()
    remove_own(str(tmp_path / "never"), (0, 0), "never")  # a name never created: nothing happens
    with pytest.raises(ValueError, match="temporary prefix"):
        remove_own(str(tmp_path / "moved"), ident, "")  # no prefix, no deletion of any name


def test_remove_own_with_a_prefix_leaves_other_names(tmp_path):
    """Every caller in symgraph names the temporary prefix it created under: a path of the
    right identity but another name (renamed by someone) is left alone."""
    from symgraph.checkpoints.outdir import identity, remove_own
    made = tmp_path / ".out.tmp-abc"
    made.mkdir()
    ident = identity(made)
    made.rename(tmp_path / "users-dir")
    remove_own(str(tmp_path / "users-dir"), ident, ".out.tmp-")
    assert (tmp_path / "users-dir").is_dir()
    (tmp_path / "users-dir").rename(made)
    remove_own(str(made), ident, ".out.tmp-")
    assert not made.exists()


def test_force_replaces_only_what_symgraph_wrote(tmp_path):
    """--force replaces a previous output only while it holds nothing but the files its marker
    lists; a file the user added there is named, refused and left in place."""
    import json
    from symgraph.errors import InputError
    from symgraph.checkpoints.outdir import MARKER, save_atomic

    def writer(d):
        (tmp_path / "w").write_text("")
        with open(f"{d}/model.safetensors", "wb") as f:
            f.write(b"x")
    out = tmp_path / "out"
    save_atomic(writer, str(out))
    assert json.loads((out / MARKER).read_text())["files"] == ["model.safetensors", MARKER]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="notes.txt"):
        save_atomic(writer, str(out), force=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    (out / "notes.txt").unlink()
    save_atomic(writer, str(out), force=True)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "model.safetensors"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_force_keeps_a_listed_file_the_user_rewrote(tmp_path):
    """A file symgraph wrote and the user has since rewritten (same name, other contents) is
    no longer symgraph's: --force is refused, names it, and it stays as the user left it."""
    from symgraph.errors import InputError
    from symgraph.checkpoints.outdir import MARKER, save_atomic, written_files

    def writer(d):
        with open(f"{d}/model.safetensors", "wb") as f:
            f.write(b"x")
    out = tmp_path / "out"
    save_atomic(writer, str(out))
    assert set(written_files(str(out))) == {"model.safetensors", MARKER}
    (out / "model.safetensors").write_bytes(b"the user's own weights")
    assert set(written_files(str(out))) == {MARKER}
    with pytest.raises(InputError, match="model.safetensors"):
        save_atomic(writer, str(out), force=True)
    assert (out / "model.safetensors").read_bytes() == b"the user's own weights"


def test_remove_own_takes_only_plain_files_out_of_a_directory(tmp_path):
    """A directory symgraph made loses the plain files in it; a subdirectory or link found
    there is not symgraph's output: it stays, and with it the directory."""
    from symgraph.checkpoints.outdir import identity, remove_own
    made = tmp_path / ".out.tmp-x"
    made.mkdir()
    (made / "model.safetensors").write_bytes(b"x")
    (made / "sub").mkdir()
    (made / "sub" / "keep").write_text("k")
    outside = tmp_path / "outside"
    outside.write_text("o")
    (made / "link").symlink_to(outside)
    remove_own(str(made), identity(made), ".out.tmp-")
    assert sorted(p.name for p in made.iterdir()) == ["link", "sub"]
    assert (made / "sub" / "keep").read_text() == "k" and outside.read_text() == "o"


"""Hostile model directories through the ``symgraph`` command: a model directory is a closed world
(shard indexes and links that point out of it are refused, nothing outside it is copied into
``--out``), one reading of a checkpoint shared by both paths (shards that disagree with their
index refused alike), dtypes from the tensors (not a stale config), config fields of the wrong
type or value in one line, outputs that never replace a user's file, and signals that end
with 130/143 wherever they arrive.

Refusals run the command in-process (``symgraph.cli.main.main``: the same entry, without a
second interpreter's start-up per case) on the out-of-core path and on the in-memory one
(``--repair`` loads the models); signal cases run it as a subprocess."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from symgraph.cli.main import main
from symgraph.testing import models

from cli_helpers import ENV, digest

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
INDEX = "model.safetensors.index.json"


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def _shards(d, sd, parts, config, *, extra=None, drop=()):
    """``d`` as a sharded checkpoint: ``parts`` = [(file, keys)], ``extra`` = {file: {key: tensor}}
    written beside them, the index listing each key at its first shard minus ``drop``."""
    d.mkdir()
    shutil.copy(config, d)
    wm = {}
    for name, keys in parts:
        save_file({k: sd[k] for k in keys} | (extra or {}).get(name, {}), str(d / name), metadata={"format": "pt"})
        for k in keys:
            wm.setdefault(k, name)
    for k in drop:
        del wm[k]
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws4")
    inp, work = root / "inputs", root / "work"
    work.mkdir()
    (root / "secret.txt").write_text("the user's own file, outside every model directory")
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    (root / "other").mkdir()
    shutil.copy(inp / "b" / "model.safetensors", root / "other" / "model.safetensors")
    sd = load_file(str(inp / "b" / "model.safetensors"))
    keys = sorted(sd)
    half = len(keys) // 2

    def variant(name, **cfg):
        shutil.copytree(inp / "b", inp / name)
        if cfg:
            _edit_config(inp / name, **cfg)
        return inp / name

    for name, target in (("index_relative", "../../other/model.safetensors"),
                         ("index_absolute", str(root / "other" / "model.safetensors"))):
        (inp / name).mkdir()
        shutil.copy(inp / "b" / "config.json", inp / name)
        (inp / name / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: target for k in keys}}))
    d = inp / "index_link"  # a plain shard name, but the shard is a link out of the directory
    d.mkdir()
    shutil.copy(inp / "b" / "config.json", d)
    os.symlink(root / "other" / "model.safetensors", d / "model-00001-of-00001.safetensors")
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors"
                                                                       for k in keys}}))
    os.symlink(root / "secret.txt", variant("tokenizer_link") / "tokenizer.model")
    os.remove(variant("generation_link") / "generation_config.json")
    os.symlink(root / "secret.txt", inp / "generation_link" / "generation_config.json")
    os.remove(variant("weights_link") / "model.safetensors")
    os.symlink(root / "other" / "model.safetensors", inp / "weights_link" / "model.safetensors")
    parts = [("s1.safetensors", keys[:half]), ("s2.safetensors", keys[half:])]
    cfg = inp / "b" / "config.json"
    _shards(inp / "in_two_shards", sd, parts, cfg, extra={"s2.safetensors": {keys[0]: sd[keys[0]] * 2}})
    _shards(inp / "not_in_index", sd, parts, cfg, drop=[keys[-1]])
    _shards(inp / "single_beside_index", sd, parts, cfg)
    save_file({k: v * 3 for k, v in sd.items()}, str(inp / "single_beside_index" / "model.safetensors"))
    ints = dict(sd)
    ints["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    save_file(ints, str(variant("integer_norm") / "model.safetensors"), metadata={"format": "pt"})
    variant("null_size", hidden_size=None)
    variant("negative_size", intermediate_size=-48)
    variant("float_layers", num_hidden_layers=2.5)
    variant("architecture_is_a_module", architectures=["logging"])
    variant("architecture_is_a_function", architectures=["set_seed"])
    variant("flash_attention", attn_implementation="flash_attention_2")
    variant("absurd_layers", num_hidden_layers=10 ** 9)
    (variant("nested_config") / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in sd.items()}, str(variant("fp8") / "model.safetensors"),
              metadata={"format": "pt"})
    # dtypes: the tensors, not the config, say what goes out
    variant("f32_under_bf16_config", dtype="bfloat16")
    save_file({k: v.half() for k, v in sd.items()}, str(variant("f16_under_f32_config") / "model.safetensors"),
              metadata={"format": "pt"})
    save_file({k: v.float() if "norm" in k else v.bfloat16() for k, v in sd.items()},
              str(variant("mixed_dtypes", dtype="bfloat16") / "model.safetensors"), metadata={"format": "pt"})
    save_file({"input_ids": torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))},
              str(inp / "data.safetensors"))
    return root


def cli(ws, *args, capsys):
    """``symgraph ARGS`` in-process from ``ws/work``: (exit code, stderr)."""
    cwd = os.getcwd()
    os.chdir(ws / "work")
    try:
        rc = main([str(a) for a in args])
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return rc, capsys.readouterr().err


def _refused(rc, err, *needles):
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err and err.count("symgraph:") - err.count("symgraph: warning") - err.count("symgraph: note") == 1, err
    flat = " ".join(err.split())
    for n in needles:
        assert n in flat, (n, flat)


I = "inputs"  # noqa: E741
PATHS = {"out_of_core": [], "in_memory": ["--repair", "--data", "../inputs/data.safetensors"]}  # from ws/work
REFUSED = [  # (model directory merged with inputs/a, what the one line must say)
    ("index_relative", ["not a plain name inside that directory", "../../other/model.safetensors"]),
    ("index_absolute", ["not a plain name inside that directory", "other/model.safetensors"]),
    ("index_link", ["points outside the model directory", "model-00001-of-00001.safetensors"]),
    ("tokenizer_link", ["tokenizer.model", "points outside the model directory", "secret.txt"]),
    ("generation_link", ["generation_config.json", "points outside the model directory"]),
    ("weights_link", ["model.safetensors", "points outside the model directory"]),
    ("in_two_shards", ["is in two shards", "exactly one shard"]),
    ("not_in_index", ["the index does not list it", "agree with model.safetensors.index.json"]),
    ("single_beside_index", ["both model.safetensors and a shard index", "ambiguous"]),
    ("integer_norm", ["'model.norm.weight' is float32", "but int64", "same kind of number"]),
    ("null_size", ["hidden_size", "config.json"]),
    ("negative_size", ["cannot build LlamaForCausalLM", "negative dimension"]),
    ("float_layers", ["num_hidden_layers", "2.5"]),
    ("architecture_is_a_module", ["'logging' is not a transformers class"]),
    ("architecture_is_a_function", ["'set_seed' is not a transformers class"]),
    ("flash_attention", ["cannot build LlamaForCausalLM", "FlashAttention2"]),
    ("absurd_layers", ["modules for a checkpoint of", "sizes match its weights"]),
    ("fp8", ["F8_E4M3", "dequantise"]),
    ("nested_config", ["config.json", "nested too deeply"]),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case,needles", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_alike_on_both_paths(ws, capsys, case, needles, path):
    before = digest(ws)
    rc, err = cli(ws, "merge", ws / I / "a", ws / I / case, "--out", ws / "o", *PATHS[path], capsys=capsys)
    _refused(rc, err, *needles)
    assert digest(ws) == before and not (ws / "o").exists()
    assert not [f for f in os.listdir(ws) if f.startswith(".")]


def test_analyze_refuses_a_link_out_of_the_model_directory(ws, capsys):
    rc, err = cli(ws, "analyze", ws / I / "generation_link", capsys=capsys)
    _refused(rc, err, "points outside the model directory")


def _dtypes(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.parametrize("case,want", [("f32_under_bf16_config", {"F32"}), ("f16_under_f32_config", {"F16"}),
                                       ("mixed_dtypes", {"F32", "BF16"})])
def test_dtypes_follow_the_tensors_on_both_paths(ws, tmp_path, capsys, case, want):
    """The anchor's tensors decide each output tensor's dtype, whatever its config says, and the
    in-memory path writes what the out-of-core one writes."""
    outs = {}
    for path, extra in PATHS.items():
        outs[path] = tmp_path / path
        rc, err = cli(ws, "merge", ws / I / case, ws / I / "a", "--out", outs[path], *extra, capsys=capsys)
        assert rc == 0, err[-2000:]
    stored = _dtypes(ws / I / case)
    assert set(stored.values()) == want
    for path, out in outs.items():
        assert _dtypes(out) == stored, path
    a, b = load_file(str(outs["out_of_core"] / "model.safetensors")), load_file(str(outs["in_memory"] / "model.safetensors"))
    for k in a:  # --repair renormalises the merged layers: close, not identical
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=0.05, rtol=0.05)


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_links(ws, tmp_path, capsys):
    """``<repo>/snapshots/<rev>/`` holds links into ``<repo>/blobs``: that is inside the cached
    repository, so it is read (the links' contents, not the links, are copied)."""
    repo = tmp_path / "models--user--b"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in os.listdir(ws / I / "b"):
        shutil.copy(ws / I / "b" / f, blobs / f"sha-{f}")
        os.symlink(f"../../blobs/sha-{f}", snap / f)
    (blobs / "sha-tok").write_text('{"x": 1}')
    os.symlink("../../blobs/sha-tok", snap / "tokenizer_config.json")
    rc, err = cli(ws, "merge", snap, ws / I / "a", "--out", tmp_path / "o", capsys=capsys)
    assert rc == 0, err[-2000:]
    copied = tmp_path / "o" / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_text() == '{"x": 1}'


def test_analyze_never_replaces_a_file_or_writes_into_an_input(ws, tmp_path, capsys):
    users = tmp_path / "graph.dot"
    users.write_text("the user's own graph")
    before = digest(ws)
    rc, err = cli(ws, "analyze", ws / I / "a", "--dot", users, capsys=capsys)
    _refused(rc, err, "already exists", "never replaces a file it did not write")
    assert users.read_text() == "the user's own graph"
    rc, err = cli(ws, "analyze", ws / I / "a", "--dot", ws / I / "a" / "g.dot", capsys=capsys)
    _refused(rc, err, "is inside the input")
    rc, err = cli(ws, "analyze", "tiny-llama", "--png", users.with_suffix(".png"), "--dot",
                  users.with_name("new.dot"), capsys=capsys)
    assert rc == 0, err
    assert users.with_name("new.dot").read_text().startswith("digraph")
    assert digest(ws) == before


def test_demo_never_writes_into_a_directory_it_did_not_make(ws, tmp_path, capsys):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "barrier.png").write_text("the user's own picture")
    rc, err = cli(ws, "demo", "--out", users, capsys=capsys)
    _refused(rc, err, "was not written by symgraph")
    assert (users / "barrier.png").read_text() == "the user's own picture"


def test_a_legal_long_out_name_is_accepted(ws, tmp_path, capsys):
    out = tmp_path / ("m" * 240)
    rc, err = cli(ws, "merge", ws / I / "a", ws / I / "b", "--out", out, capsys=capsys)
    assert rc == 0, err[-2000:]
    assert (out / "model.safetensors").is_file()


def _run_killed(ws, code):
    """Run ``code`` (which drives ``symgraph.cli.main.main`` and sends itself SIGTERM at a chosen
    point) as a subprocess: (exit code, stderr)."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ws / "work", env=ENV, capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stderr


def _killer(target: str, attr: str) -> str:
    """Python that wraps ``target.attr`` to send this process SIGTERM on its first call."""
    return (f"import os, signal, importlib\nm = importlib.import_module({target!r})\norig = getattr(m, {attr!r})\n"
            f"def hit(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return orig(*a, **k)\n"
            f"setattr(m, {attr!r}, hit)\n")


@pytest.mark.parametrize("where", ["tracing", "reading_headers"])
@pytest.mark.slow
def test_sigterm_ends_with_143_wherever_it_arrives(ws, where):
    """A signal inside code wrapped in a broad ``except`` (torch.export, safetensors) is never
    reported as bad input."""
    target = {"tracing": ("torch.export", "export"), "reading_headers": ("safetensors", "safe_open")}[where]
    before = digest(ws)
    code = (_killer(*target) + "import sys\nfrom symgraph.cli.main import main\n"
            f"sys.exit(main(['merge', {str(ws / I / 'a')!r}, {str(ws / I / 'b')!r}, '--out', "
            f"{str(ws / 'sig')!r}]))\n")
    rc, err = _run_killed(ws, code)
    assert rc == 143 and "terminated (SIGTERM); nothing was written" in err and "Traceback" not in err, err[-2000:]
    assert digest(ws) == before and not [f for f in os.listdir(ws) if f.startswith(".") or f == "sig"]


@pytest.mark.slow
def test_sigterm_while_force_replaces_never_hides_the_previous_output(ws, tmp_path, capsys):
    """SIGTERM right after the previous output is moved aside: the new output still goes into
    place (the signal waits for the swap) and the command says so."""
    out = tmp_path / "o"
    rc, err = cli(ws, "merge", ws / I / "a", ws / I / "b", "--align", "none", "--out", out, capsys=capsys)
    assert rc == 0, err
    code = ("import os, signal, sys\nimport symgraph.checkpoints.outdir as o\nreal = os.replace\nseen = []\n"
            "def replace(a, b):\n    real(a, b)\n    if os.path.basename(b).startswith('.symgraph-old-'):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "o.os = type(os)('os_shim')\no.os.__dict__.update(os.__dict__)\no.os.replace = replace\n"
            "from symgraph.cli.main import main\n"
            f"sys.exit(main(['merge', {str(ws / I / 'a')!r}, {str(ws / I / 'b')!r}, '--out', {str(out)!r}, "
            "'--force']))\n")
    rc, err = _run_killed(ws, code)
    assert rc == 143 and "was already complete" in " ".join(err.split()) and "Traceback" not in err, err[-2000:]
    assert json.loads((out / "symgraph_merge.json").read_text())["options"]["align"] == "weights"  # the new one
    assert sorted(os.listdir(tmp_path)) == ["o"]  # nothing hidden under a temporary name

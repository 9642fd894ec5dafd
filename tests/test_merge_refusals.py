"""Refusals of a merge through the ``symgraph`` command: an ``--out`` inside an input (also
through a link), a config that differs in what the model computes (both paths), models stored
in different dtypes, a width whose model cannot fit, a disk that fills while writing. Each
ends in exit 2 and one paragraph, or a correct result; nothing outside ``--out`` changes."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import symgraph
from symgraph.testing import models

from cli_helpers import ENV, digest, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws3")
    inp = root / "inputs"
    (root / "work").mkdir()
    (root / "notes.txt").write_text("the user's own file")
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).to(torch.bfloat16).save_pretrained(inp / "b16")
    models.build("llama", seed=1, rope_theta=500.0, **L).save_pretrained(inp / "theta")
    models.build("llama", seed=1, hidden_act="gelu", **L).save_pretrained(inp / "gelu")
    save_file({"input_ids": torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))},
              str(inp / "data.safetensors"))
    os.symlink(inp / "a", root / "link_to_a")
    return root


def run(ws, *args, preexec=None):
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ws / "work", timeout=300, preexec_fn=preexec)


I = "inputs"  # noqa: E741
CASES = [
    ("out_inside_input", lambda w: ["merge", w / I / "a", w / I / "b16", "--out", w / I / "a" / "merged"],
     ["inside the input directory"]),
    ("out_inside_input_through_link", lambda w: ["merge", w / "link_to_a", w / I / "b16", "--out",
                                                 w / I / "a" / "merged"], ["inside the input directory"]),
    ("rope_theta_differs_out_of_core", lambda w: ["merge", w / I / "a", w / I / "theta", "--out", w / "o"],
     ["rope_theta", "500.0", "changes what the model computes"]),
    ("hidden_act_differs_out_of_core", lambda w: ["merge", w / I / "a", w / I / "gelu", "--align", "none",
                                                  "--out", w / "o"], ["'hidden_act'", "'silu' vs 'gelu'"]),
    ("hidden_act_differs_in_memory", lambda w: ["merge", w / I / "a", w / I / "gelu", "--repair", "--data",
                                                w / I / "data.safetensors", "--out", w / "o"], ["'hidden_act'"]),
    ("data_is_a_directory", lambda w: ["merge", w / I / "a", w / I / "b16", "--align", "activations", "--data",
                                       w / I, "--out", w / "o"], ["is a directory", ".safetensors"]),
    ("resize_to_the_current_width", lambda w: ["resize", w / I / "a", "--width", "5=48", "--out", w / "o"],
     ["already 48 wide", "new width"]),
    ("resize_beyond_memory", lambda w: ["resize", w / I / "a", "--width", "5=1000000000", "--out", w / "o"],
     ["GiB is available", "fits in memory"]),
]


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_refusal(ws, case, argv, needles):
    before = digest(ws)
    refused(run(ws, *argv(ws)), *needles)
    assert digest(ws) == before


def test_an_out_that_is_a_link_is_refused_and_its_target_untouched(ws, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere" / "new", tmp_path / "dangling")  # a new directory there, if followed
    os.symlink(tmp_path / "elsewhere", tmp_path / "to_dir")
    for link in ("dangling", "to_dir"):
        r = run(ws, "merge", ws / I / "a", ws / I / "b16", "--out", tmp_path / link)
        refused(r, "is a symbolic link", "expected the path of a directory itself")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_resize_class_5_is_an_mlp_class(ws):
    """The resize case above names class 5: it must be a permutation class (the memory check,
    not a kind refusal, is what stops it)."""
    A = models.build("llama", seed=0, **L)
    g = {g.id: g for g in symgraph.analyze(A).groups}[5]
    assert g.kind == "perm" and g.size == 48


@pytest.mark.parametrize("align", ["weights", pytest.param("activations", marks=pytest.mark.slow)])  # 28 s; budget
@pytest.mark.slow
def test_mixed_dtypes_merge_in_float32_written_in_the_anchors_dtype(ws, tmp_path, align):
    out = tmp_path / "o"
    extra = ["--data", ws / I / "data.safetensors"] if align == "activations" else []
    r = run(ws, "merge", ws / I / "a", ws / I / "b16", "--align", align, *extra, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in got.values()} == {torch.float32}  # the anchor's dtype
    A = models.build("llama", seed=0, **L)
    B = models.build("llama", seed=1, **L).to(torch.bfloat16).float()  # the stored values, exactly
    data = [{"input_ids": safe_open(str(ws / I / "data.safetensors"), "pt").get_tensor("input_ids")}] \
        if align == "activations" else None
    want = symgraph.merge([A, B], align=align, data=data).model.state_dict()
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], atol=1e-5, rtol=0)
    card = (out / "README.md").read_text()
    assert "stored in float32 and bfloat16" in card and "float32" in json.loads(
        (out / "symgraph_merge.json").read_text())["input_dtypes"]


def _small_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


@pytest.mark.parametrize("path", ["out_of_core", pytest.param("in_memory", marks=pytest.mark.slow)])  # 24 s; budget
@pytest.mark.slow
def test_disk_full_while_writing_is_one_line_and_leaves_nothing(ws, path):
    extra = ["--repair", "--data", ws / I / "data.safetensors"] if path == "in_memory" else []
    before = digest(ws)
    r = run(ws, "merge", ws / I / "a", ws / I / "a", *extra, "--out", ws / "work" / "o", preexec=_small_files)
    refused(r, "failed", "nothing was written", "free space")
    assert digest(ws) == before and sorted(os.listdir(ws / "work")) == []  # no output, no temporary


@pytest.mark.slow  # the float32-anchor cases above cover mixed dtypes in the default run
def test_mixed_dtypes_with_a_bfloat16_anchor_written_in_bfloat16(ws, tmp_path):
    out = tmp_path / "o"
    r = run(ws, "merge", ws / I / "b16", ws / I / "a", "--align", "activations", "--data",
            ws / I / "data.safetensors", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    A = models.build("llama", seed=1, **L).to(torch.bfloat16).float()
    B = models.build("llama", seed=0, **L)
    data = [{"input_ids": safe_open(str(ws / I / "data.safetensors"), "pt").get_tensor("input_ids")}]
    want = symgraph.merge([A, B], align="activations", data=data).model.state_dict()
    for k, v in got.items():  # merged in float32 on both sides, then rounded to bfloat16
        torch.testing.assert_close(v.float(), want[k].to(torch.bfloat16).float(), atol=1e-6, rtol=1e-2)


@pytest.mark.slow  # 24 s; the meta trace's constants are checked by default in tests/test_meta_constants.py
def test_falcon_activation_alignment_runs_out_of_core_with_its_index_constants(ws, tmp_path, monkeypatch, capsys):
    """A multi-query attention that creates index constants in its forward (Falcon's before
    transformers 5.25, :mod:`index_constants`); traced on meta they hold no values, so the trace
    takes them from a fake-CPU twin (``passes.trace._constants_from_fake_twin``) and ``symgraph
    merge`` (in this process, where the forward is patched) runs out of core, equal to the
    in-memory merge. Without the twin's values the job is refused out of core, and ``symgraph
    merge`` loads the models (it used to read uninitialised memory)."""
    import transformers
    from index_constants import falcon_config, index_split_falcon
    from symgraph import merge_checkpoints
    from symgraph.cli.main import main
    from symgraph.passes import trace as trace_module
    index_split_falcon(monkeypatch)
    paths = []
    for s in (0, 1):
        torch.manual_seed(s)
        cfg = falcon_config(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        transformers.FalconForCausalLM(cfg).save_pretrained(tmp_path / f"f{s}")
        paths.append(tmp_path / f"f{s}")
    data_file = ws / I / "data.safetensors"
    code = main(["merge", *map(str, paths), "--align", "activations", "--data", str(data_file),
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0 and "loaded in memory" not in err, err[-2000:]
    assert json.loads((tmp_path / "o" / "symgraph_merge.json").read_text())["mode"] == "streaming"
    from symgraph.app.config import MergeConfig
    from symgraph.app.run import run_merge
    cfg = MergeConfig(models=[str(p) for p in paths], out=str(tmp_path / "mem"), align="activations",
                      data=str(data_file))
    assert run_merge(cfg, streaming=False, progress=False).mode == "in-memory"
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "o" / "model.safetensors")), load_file(str(tmp_path / "mem" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    data = [{"input_ids": safe_open(str(data_file), "pt").get_tensor("input_ids")}]
    monkeypatch.setattr(trace_module, "_constants_from_fake_twin", lambda *a, **k: None)
    with pytest.raises(symgraph.InputError, match="cannot run out of core: the traced graph creates tensor constants"):
        merge_checkpoints([str(p) for p in paths], str(tmp_path / "o2"), align="activations", data=data)
    assert not (tmp_path / "o2").exists()


def test_model_card_keeps_non_ascii_paths():
    from symgraph.app.config import MergeConfig, to_yaml
    text = to_yaml(MergeConfig(models=["/data/modèle_a", "/data/b"], out="fusionné"))
    assert "modèle_a" in text and "\\x" not in text and "\\u" not in text  # not escaped


def test_integer_tensors_are_the_anchors_never_averaged(tmp_path):
    """BatchNorm's num_batches_tracked (int64) differs between models trained for different
    lengths: the merge keeps the anchor's, exactly, on the out-of-core path."""
    import transformers
    from safetensors.torch import load_file

    from symgraph import merge_checkpoints
    for s, count in ((0, 7), (1, 1000001)):
        torch.manual_seed(s)
        cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                        layer_type="basic", num_labels=3)
        cfg.architectures = ["ResNetForImageClassification"]
        m = transformers.ResNetForImageClassification(cfg).eval()
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.num_batches_tracked.fill_(count)
        m.save_pretrained(tmp_path / f"r{s}")
    merge_checkpoints([str(tmp_path / "r0"), str(tmp_path / "r1")], str(tmp_path / "o"), align="weights")
    out = load_file(str(tmp_path / "o" / "model.safetensors"))
    ints = {k: v for k, v in out.items() if not v.dtype.is_floating_point}
    assert ints and all(v.dtype == torch.int64 and int(v) == 7 for v in ints.values())


def test_special_files_bad_indexes_and_yaml_values_are_one_line(ws, tmp_path, capsys):
    """Inputs that are not regular files (a FIFO would block the read forever), a shard index
    that is not save_pretrained's, and a config file's value named as the config's (not as a
    flag). In process, with an alarm: a blocked read fails the test instead of hanging it."""
    import shutil
    from symgraph.cli.main import main
    a, b = ws / I / "a", ws / I / "b16"
    os.mkfifo(tmp_path / "fifo.safetensors")
    fifo_dir = tmp_path / "fifo_dir"
    fifo_dir.mkdir()
    shutil.copy(a / "config.json", fifo_dir / "config.json")
    os.mkfifo(fifo_dir / "model.safetensors")
    sharded = tmp_path / "sharded"
    models.build("llama", seed=0, **L).save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    bad = {}
    for name, text in (("no_metadata", json.dumps({"weight_map": index["weight_map"]})),
                       ("int_map", json.dumps({"metadata": {}, "weight_map": 5})), ("a_list", "[1, 2]")):
        shutil.copytree(sharded, tmp_path / name)
        (tmp_path / name / "model.safetensors.index.json").write_text(text)
        bad[name] = tmp_path / name
    (tmp_path / "neg.yaml").write_text(f"models: [{a}, {b}]\nrefine: -3\nout: {tmp_path / 'o'}\n")
    (tmp_path / "repair.yaml").write_text(f"models: [{a}, {b}]\nrepair: true\nout: {tmp_path / 'o'}\n")
    cases = [
        (["merge", a, b, "--align", "activations", "--data", tmp_path / "fifo.safetensors"], ["FIFO", "regular file"]),
        (["merge", a, fifo_dir], ["FIFO", "model.safetensors"]),
        (["merge", "--config", tmp_path / "fifo.safetensors"], ["merge config", "FIFO"]),
        (["analyze", bad["no_metadata"]], ["no 'metadata' object"]),
        (["merge", a, bad["no_metadata"]], ["no 'metadata' object"]),
        (["merge", a, bad["int_map"]], ["'weight_map' that is a int"]),
        (["analyze", bad["a_list"]], ["holds a JSON list"]),
        (["merge", "--config", tmp_path / "neg.yaml"], ["key 'refine' is -3", "number of steps"]),
        (["merge", "--config", tmp_path / "repair.yaml"], ["'repair:' in", "needs --data FILE"]),
    ]
    before = digest(ws)
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("blocked")))
    try:
        for argv, needles in cases:
            argv = [str(x) for x in argv] + (["--out", str(tmp_path / "o")] if argv[0] == "merge"
                                              and "--config" not in argv else [])
            signal.alarm(60)
            rc = main(argv)
            signal.alarm(0)
            err = capsys.readouterr().err
            assert rc == 2 and "Traceback" not in err and err.count("symgraph:") == 1, (argv, err)
            for n in needles:
                assert n in " ".join(err.split()), (argv, n, err)
            assert not (tmp_path / "o").exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert digest(ws) == before


def test_unaligned_models_of_other_widths_or_classes_are_refused_naming_the_tensor():
    """The engine's check of its checkpoints (``sharded.check_pair``, as ``symgraph align`` and
    ``barrier`` check theirs): without alignment the first tensor whose shape differs is named
    with both shapes; models of two classes are refused at any alignment."""
    from symgraph.checkpoints.memory import ModelCheckpoint
    from symgraph.merging.streaming import StreamingMerge
    a, wide = models.build("llama", seed=0, **L), models.build("llama", seed=1, **{**L, "mlp": 40})
    pair = [ModelCheckpoint(a, "model 0"), ModelCheckpoint(wide, "model 1")]
    with pytest.raises(symgraph.InputError, match=r"^'model 0' and 'model 1' differ in tensor 'model\.layers\.0\.mlp"
                       r"\.down_proj\.weight' \(\(32, 48\) vs \(32, 40\)\); without alignment .* --align weights\) "
                       r"\(configs differ: intermediate_size 48 vs 40\)$"):
        StreamingMerge(pair, align=None)
    assert StreamingMerge(pair, align="weights").alignments == [None, None]  # aligned: other widths are fine
    gpt = models.build("gpt2", seed=0, vocab=64, hidden=32, layers=2, heads=4, positions=64)
    with pytest.raises(symgraph.InputError, match=r"^'model 0' is a LlamaForCausalLM but 'model 1' is a "
                       r"GPT2LMHeadModel; expected models of one architecture$"):
        StreamingMerge([pair[0], ModelCheckpoint(gpt, "model 1")])


@pytest.mark.parametrize("entry", ["merge", "engine"])
def test_models_whose_configs_change_the_function_are_refused_by_every_entry(entry):
    """``symgraph.merge`` in Python and the engine refuse, before any work, models whose configs
    differ in a field that changes the function but no shape (a norm epsilon): the merge
    would silently follow the anchor's, as the command line already refused."""
    from symgraph.checkpoints.memory import ModelCheckpoint
    from symgraph.merging.streaming import StreamingMerge
    a = models.build("llama", seed=0, **L)
    b = models.build("llama", seed=1, **L)
    b.config.rms_norm_eps = 1e-2
    want = (r"^'model 0' and 'model 1' differ in config field 'rms_norm_eps' \(1e-06 vs 0\.01\), which changes "
            r"what the model computes; expected models of one configuration \(apart from widths an alignment can "
            r"bridge\)$")
    with pytest.raises(symgraph.InputError, match=want):
        if entry == "merge":
            symgraph.merge([a, b])
        else:
            StreamingMerge([ModelCheckpoint(a, "model 0"), ModelCheckpoint(b, "model 1")])
    b.config.rms_norm_eps = a.config.rms_norm_eps  # the same configs: merged
    assert torch.isfinite(next(symgraph.merge([a, b]).model.parameters())).all()


@pytest.mark.parametrize("entry", ["merge-activations", "merge-repair", "merge-regmean", "align", "compare",
                                   "analyze", "engine"])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_batch(entry):
    """A batch whose ``input_ids`` leave the vocabulary (here the second of two) is refused in
    one line naming the batch and the range, before any model runs on it: it used to end in the
    embedding's "IndexError: index out of range in self" (every Python entry taking data)."""
    from symgraph.checkpoints.memory import ModelCheckpoint
    from symgraph.merging.streaming import StreamingMerge
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    good, bad = {"input_ids": torch.tensor([[1, 2, 3]])}, {"input_ids": torch.tensor([[1, 64, 3]])}
    run = {"merge-activations": lambda: symgraph.merge([a, b], data=[good, bad], align="activations"),
           "merge-repair": lambda: symgraph.merge([a, b], data=[good, bad], repair=True),
           "merge-regmean": lambda: symgraph.merge([a, b], data=[good, bad], method="regmean"),
           "align": lambda: symgraph.align(a, b, data=[good, bad]),
           "compare": lambda: symgraph.compare(a, b, data=[good, bad]),
           "analyze": lambda: symgraph.analyze(a, {"input_ids": torch.tensor([[-1, 2]])}),
           "engine": lambda: StreamingMerge([ModelCheckpoint(a, "model 0"), ModelCheckpoint(b, "model 1")],
                                            data=[good, bad], align="activations")}[entry]
    where = "'input_ids' of the inputs" if entry == "analyze" else r"'input_ids' of data\[1\]"
    lo, hi = (-1, 2) if entry == "analyze" else (1, 64)
    with pytest.raises(symgraph.InputError, match=rf"^{where} range over \[{lo}, {hi}\]; expected ids in \[0, 63\] "
                       r"\(the model's vocabulary of 64 tokens\)$"):
        run()


@pytest.mark.parametrize("case", ["float-ids", "mask-shape", "mixed-inputs"])
def test_batches_that_are_not_the_models_inputs_are_refused_naming_the_batch(case):
    """Batches the model cannot run are refused in one line naming the batch, before any model
    runs: float ``input_ids`` (were torch.export's trace error), a mask of another shape than its
    ids (were a broadcast error in the trace), batches of different inputs (were a KeyError)."""
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    ids = torch.randint(0, 64, (2, 5))
    data, want = {
        "float-ids": ([{"input_ids": ids}, {"input_ids": ids.float()}],
                      r"^'input_ids' of data\[1\] has dtype float32 \(not token ids\); expected an integer tensor"),
        "mask-shape": ([{"input_ids": ids, "attention_mask": torch.ones(3, 7)}],
                       r"^'attention_mask' of data\[0\] has shape \(3, 7\) but its 'input_ids' \(2, 5\); expected "
                       r"one mask entry per token$"),
        "mixed-inputs": ([{"input_ids": ids}, {"pixel_values": torch.randn(1, 3, 8, 8)}],
                         r"^data\[1\] holds \['pixel_values'\] where data\[0\] holds \['input_ids'\]; expected "
                         r"batches of the same inputs$")}[case]
    with pytest.raises(symgraph.InputError, match=want):
        symgraph.merge([a, b], data=data, align="activations")
    with pytest.raises(symgraph.InputError, match=want):
        symgraph.align(a, b, data=data)
    good = [{"input_ids": ids, "attention_mask": torch.ones(2, 5, dtype=torch.long)}] * 2
    assert symgraph.merge([a, b], data=good, align="activations").alignments[1] is not None


def test_a_model_without_values_is_refused_by_merge_and_align():
    """A model on ``meta`` (built without weights) was traced like any other and ended in a
    structure mismatch between the two graphs; refused naming the model and a parameter."""
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L).to("meta")
    want = r"has parameter 'model\.embed_tokens\.weight' on the meta device \(no values\); expected a model with"
    with pytest.raises(symgraph.InputError, match=r"^model 1 " + want):
        symgraph.merge([a, b])
    with pytest.raises(symgraph.InputError, match=r"^model_b " + want):
        symgraph.align(a, b)


@pytest.mark.parametrize("entry", ["analyze", "merge", "align"])
def test_an_input_no_forward_takes_is_refused_not_dropped(entry):
    """A misspelled keyword (``atention_mask``) reached transformers' ``**kwargs`` and was
    dropped unread: the analysis and the merge ran as if no mask had been given. Now it is
    refused in one line naming it. Names a submodule's forward takes (the typed ``**kwargs``
    hand them on) and any name of a forward with untyped ``**kwargs`` still pass."""
    a, b = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    batch = {"input_ids": torch.randint(0, 64, (2, 5)), "atention_mask": torch.ones(2, 5, dtype=torch.long)}
    run = {"analyze": lambda: symgraph.analyze(a, batch),
           "merge": lambda: symgraph.merge([a, b], data=[batch, batch], align="activations"),
           "align": lambda: symgraph.align(a, b, data=[batch])}[entry]
    where = "the inputs" if entry == "analyze" else r"data\[0\]"
    with pytest.raises(symgraph.InputError, match=rf"^{where} hold \['atention_mask'\], which no forward of "
                       r"LlamaForCausalLM takes; expected inputs among \[.*'attention_mask'"):
        run()
    good = {"input_ids": batch["input_ids"], "attention_mask": batch["atention_mask"],
            "position_ids": torch.arange(5)[None]}
    assert symgraph.analyze(a, good).groups  # named parameters and the typed **kwargs' keys pass

    class Free(torch.nn.Module):  # untyped **kwargs: any keyword may be read
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, **kw):
            return self.fc(x) * kw.get("scale", 1.0)
    assert symgraph.analyze(Free(), {"x": torch.randn(2, 4), "scale": 2.0}) is not None

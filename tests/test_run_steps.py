"""``run_merge`` as its steps (issue 61): the inputs checked once, before any work
(:class:`symgraph.checkpoints.inputs.Inputs`: the output, the headers, the data file, the
shard size), the data read for a model with a warning when too few rows feed statistics, and
the same record on both paths (:func:`symgraph.app.record.record`)."""
from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from symgraph.app.config import build_config
from symgraph.app.run import run_merge
from symgraph.checkpoints.inputs import DEFAULT_SHARD, MIN_USEFUL_ROWS, Inputs, read_batches
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.errors import InputError
from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    models.build("llama", seed=0, **L).save_pretrained(root / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "b")
    models.build("llama", seed=2, **L).save_pretrained(root / "sharded", max_shard_size="20KB")
    save_file({"input_ids": torch.randint(0, 64, (4, 8))}, str(root / "few.safetensors"))
    return root


def test_inputs_are_checked_once_with_the_headers_and_the_shard_size(ws, tmp_path):
    a, b, s = (str(ws / n) for n in ("a", "b", "sharded"))
    data = str(ws / "few.safetensors")
    inputs = Inputs.check([a, b], str(tmp_path / "o"), data=data)
    assert inputs.out == str(tmp_path / "o") and inputs.files == [a, b, data] and inputs.local
    assert [lay.keys for lay in inputs.layouts] == [Checkpoint(a).keys, Checkpoint(b).keys]
    assert inputs.shard == DEFAULT_SHARD  # one file: the default
    shards = sorted(os.path.getsize(os.path.join(s, f)) for f in os.listdir(s) if f.endswith(".safetensors"))
    assert len(shards) > 1
    assert Inputs.check([a, s], str(tmp_path / "o"), anchor=1).shard == shards[-1]  # sharded like the anchor
    assert Inputs.check([s, a], str(tmp_path / "o"), max_shard_size="1MB").shard == 10 ** 6
    ckpts = inputs.open([a, b])
    assert [c.path for c in ckpts] == [a, b] and ckpts[0].keys == inputs.layouts[0].keys
    assert not Inputs.check([a, "tiny-llama"], str(tmp_path / "o")).local  # a demo name has no headers


def test_the_output_is_refused_before_a_model_or_the_data_file_is_looked_at(ws, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("not symgraph's")
    with pytest.raises(InputError, match="already exists and was not written by symgraph"):
        Inputs.check([str(tmp_path / "missing"), str(ws / "b")], str(tmp_path / "taken"),
                     data=str(tmp_path / "missing.safetensors"))
    with pytest.raises(InputError, match="merge needs an output directory"):
        Inputs.check([str(ws / "a"), str(ws / "b")], None)
    with pytest.raises(FileNotFoundError, match="data file .* does not exist"):
        Inputs.check([str(ws / "a"), str(ws / "b")], str(tmp_path / "o"), data=str(tmp_path / "missing.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_too_few_rows_for_statistics_warn_once(ws, capsys):
    model = models.build("llama", seed=0, **L)
    batches = read_batches(str(ws / "few.safetensors"), model)
    assert [b["input_ids"].shape for b in batches] == [torch.Size([4, 8])]
    err = capsys.readouterr().err
    assert err.count("symgraph: warning: only 4 rows of data") == 1 and f"fewer than {MIN_USEFUL_ROWS}" in err
    assert read_batches(str(ws / "few.safetensors"), model, statistics=False)[0]["input_ids"].shape == (4, 8)
    assert read_batches(None, model) is None and capsys.readouterr().err == ""  # seen_rows only: no warning


@pytest.mark.parametrize("streaming", [True, False])
def test_the_data_file_is_checked_once_where_the_inputs_are(ws, tmp_path, monkeypatch, streaming):
    """One check of the data file per run (``Inputs.check``), whichever path reads it; the
    batches read from it are the ones :func:`~symgraph.checkpoints.specs.load_data` gives."""
    import symgraph.checkpoints.inputs as inputs_module
    import symgraph.checkpoints.specs as specs
    import symgraph.core.files as files
    from symgraph.checkpoints.specs import load_data
    seen, check = [], files.check_input_file
    for module in (files, specs, inputs_module):  # every name the check goes by
        monkeypatch.setattr(module, "check_input_file", lambda p, what, *a: (seen.append((str(p), what)),
                                                                            check(p, what, *a)))
    data = str(ws / "few.safetensors")
    cfg = build_config({"models": [str(ws / "a"), str(ws / "b")], "out": str(tmp_path / "o"), "data": data,
                        "align": "activations"})
    outcome = run_merge(cfg, streaming=streaming, progress=False)
    assert outcome.mode == ("streaming" if streaming else "in-memory")
    assert seen == [(data, "data file")]
    model = models.build("llama", seed=0, **L)
    assert [b["input_ids"].tolist() for b in read_batches(data, model)] == [b["input_ids"].tolist()
                                                                            for b in load_data(data, model)]


@pytest.mark.parametrize("fields, takes", [({}, False), ({"align": "activations"}, True), ({"repair": True}, True),
                                          ({"method": "regmean"}, True), ({"seen_rows": True}, False),
                                          ({"refine": 2, "align": "activations"}, True)])
def test_takes_statistics_says_once_which_merges_read_data(fields, takes):
    cfg = build_config({"models": ["a", "b"], "data": "d.safetensors", **fields})
    assert cfg.takes_statistics is takes


def test_unused_data_is_said_after_a_refusal_never_before_it(ws, tmp_path, capsys):
    """An unused --data is a warning once the inputs are checked: a refused run prints its one
    line and nothing else."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("x")
    before = digest(ws)
    r = main_in_process(pathlib.Path(tmp_path), "merge", ws / "a", ws / "b", "--data", ws / "few.safetensors",
                        "--out", tmp_path / "taken", cwd=".", capsys=capsys)
    refused(r, "already exists and was not written by symgraph")
    assert "warning" not in r.stderr and r.stderr.count("symgraph:") == 1, r.stderr
    assert digest(ws) == before


def test_both_paths_record_the_same_keys(ws, tmp_path, capsys):
    metas = {}
    for streaming in (True, False):
        out = tmp_path / f"o{streaming}"
        cfg = build_config({"models": [str(ws / "a"), str(ws / "b")], "out": str(out), "data": str(ws / "few.safetensors")})
        outcome = run_merge(cfg, streaming=streaming, progress=False)
        assert outcome.mode == ("streaming" if streaming else "in-memory")
        metas[streaming] = json.loads((out / "symgraph_merge.json").read_text())
        assert metas[streaming]["options"]["data"] is None  # unused by a weight-matched average: dropped
        assert (out / "README.md").read_text().count("data:") <= 1
    assert list(metas[True]) == list(metas[False])
    for key in ("inputs", "dtype", "input_dtypes", "architecture", "width_change", "universe", "repair"):
        assert metas[True][key] == metas[False][key], key
    assert metas[True]["inputs"] == [str(ws / "a"), str(ws / "b")] and metas[True]["dtype"] == "float32"
    err = capsys.readouterr().err
    assert err.count("is used by no step of this merge") == 2  # once per run

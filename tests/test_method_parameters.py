"""Merge methods declare their typed parameters once (a pydantic ``Parameters`` model): the
constructor, YAML ``parameters:`` (mergekit's key), ``--parameter NAME=VALUE`` and the record
``symgraph_merge.json`` take them from it; an unknown or invalid one is refused in one line
naming the method's parameters."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from symgraph.cli.main import main
from symgraph.errors import InputError
from symgraph.app.config import MergeConfig, merge_options, read_merge_config
from symgraph.merging.methods.registry import get
from symgraph.testing import models

from engine_helpers import load

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("params")
    models.build("llama", seed=0, **L).save_pretrained(root / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "b")
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(root / "data.safetensors"))
    return root


def _cli(ws, capsys, *args):
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def test_methods_declare_typed_parameters():
    assert get("regmean").parameters() == {"alpha": 0.9} and get("fisher").parameters() == {"eps": 1e-12}
    assert get("regmean", alpha=0.1).alpha == 0.1 and get("regmean", alpha=1).alpha == 1.0
    assert get("average").parameters() == {}
    with pytest.raises(InputError, match=r"merge method 'regmean' has no parameter 'beta'; expected alpha \(default 0.9"):
        get("regmean", beta=1)
    with pytest.raises(InputError, match="parameter 'alpha' is 2 .*; expected alpha"):
        get("regmean", alpha=2)
    with pytest.raises(InputError, match="parameter 'alpha' is True"):  # a boolean is no number
        get("regmean", alpha=True)
    with pytest.raises(InputError, match="parameter 'eps' is nan"):
        get("fisher", eps=float("nan"))
    with pytest.raises(InputError, match="'average' takes none"):
        get("average", alpha=0.5)


def test_config_types_the_command_line_values_and_checks_them_in_python():
    cfg = merge_options({"models": ["a", "b"], "out": "o", "data": "d.pt", "method": "regmean",
                         "parameters": ["alpha=0.1"]})
    assert cfg.parameters == {"alpha": 0.1}
    cfg = merge_options({"models": ["a", "b"], "out": "o", "data": "d.pt", "method": "fisher",
                         "parameters": ["eps=1e-3"]})
    assert cfg.parameters == {"eps": 1e-3}
    with pytest.raises(InputError, match="is not NAME=VALUE; expected e.g. --parameter alpha=0.1"):
        merge_options({"models": ["a", "b"], "out": "o", "method": "regmean", "parameters": ["alpha"]})
    with pytest.raises(InputError, match="--parameter .*no parameter 'beta'; expected alpha"):
        merge_options({"models": ["a", "b"], "out": "o", "data": "d", "method": "regmean", "parameters": ["beta=1"]})
    with pytest.raises(InputError, match="no parameter 'beta'"):  # a config built in Python is checked too
        MergeConfig(models=["a", "b"], method="regmean", parameters={"beta": 1})
    assert MergeConfig(models=["a", "b"], method="regmean", data="d", parameters={"alpha": 0}).parameters == \
        {"alpha": 0.0}


def test_yaml_and_mergekit_parameters(ws):
    (ws / "p.yaml").write_text("models: [a, b]\nmethod: regmean\ndata: data.safetensors\nparameters: {alpha: 0.25}\n")
    assert read_merge_config(str(ws / "p.yaml"))["parameters"] == {"alpha": 0.25}
    (ws / "mk.yaml").write_text("merge_method: regmean\nmodels:\n  - model: a\n  - model: b\n"
                                "parameters: {alpha: 0.5, normalize: true}\ndata: data.safetensors\n")
    assert read_merge_config(str(ws / "mk.yaml"))["parameters"] == {"alpha": 0.5}
    (ws / "bad.yaml").write_text("models: [a, b]\nmethod: regmean\nparameters: {gamma: 1}\n")
    with pytest.raises(InputError, match="key 'parameters'.*no parameter 'gamma'; expected alpha"):
        read_merge_config(str(ws / "bad.yaml"))


def test_regmean_alpha_reaches_the_merge_and_the_record(ws, capsys):
    outs = {}
    for alpha in (0.1, 0.9):
        (ws / f"r{alpha}.yaml").write_text(f"models: [a, b]\nmethod: regmean\ndata: data.safetensors\n"
                                           f"parameters: {{alpha: {alpha}}}\nout: out{alpha}\n")
        rc, err = _cli(ws, capsys, "merge", "--config", ws / f"r{alpha}.yaml")
        assert rc == 0, err
        rec = json.loads((ws / f"out{alpha}" / "symgraph_merge.json").read_text())
        assert rec["options"]["method"] == "regmean" and rec["options"]["parameters"] == {"alpha": alpha}
        outs[alpha] = load(ws / f"out{alpha}")
    # the flag gives the same merge as the YAML key
    rc, err = _cli(ws, capsys, "merge", ws / "a", ws / "b", "--method", "regmean", "--data",
                   ws / "data.safetensors", "--parameter", "alpha=0.1", "--out", ws / "flag")
    assert rc == 0, err
    flagged = load(ws / "flag")
    assert all(torch.equal(flagged[k], outs[0.1][k]) for k in flagged)
    differ = [k for k in outs[0.1] if not torch.equal(outs[0.1][k], outs[0.9][k])]
    assert any(k.endswith("proj.weight") for k in differ), differ  # the linear layers RegMean solves
    # the default is recorded too
    rc, err = _cli(ws, capsys, "merge", ws / "a", ws / "b", "--method", "regmean", "--data",
                   ws / "data.safetensors", "--out", ws / "default")
    assert rc == 0, err
    rec = json.loads((ws / "default" / "symgraph_merge.json").read_text())
    assert rec["options"]["parameters"] == {"alpha": 0.9}


def test_unknown_parameter_refused_in_one_line(ws, capsys):
    rc, err = _cli(ws, capsys, "merge", ws / "a", ws / "b", "--method", "regmean", "--data",
                   ws / "data.safetensors", "--parameter", "beta=0.1", "--out", ws / "never")
    assert rc == 2 and "Traceback" not in err and err.count("symgraph:") == 1, err  # one message (wrapped)
    err = " ".join(err.split())
    assert "no parameter 'beta'" in err and "expected alpha (default 0.9" in err
    assert not (ws / "never").exists()

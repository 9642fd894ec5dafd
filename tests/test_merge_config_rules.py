"""One frozen MergeConfig for every entry point: the rules between its fields ("repair needs
data", "sketch needs weight matching", ...) are its validator, so a config built in Python is
refused with the same one line as the command line, a YAML file's options are checked once the
command line has completed them, and ``merge_checkpoints`` builds and checks the same config."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.cli.main import main
from symgraph.errors import InputError
from symgraph.app.config import MergeConfig, build_config, merge_options, read_merge_config
from symgraph.app.run import merge_checkpoints
from symgraph.testing import models

CASES = [  # (fields, the command line's flags, what the refusal says)
    (dict(repair=True), ["--repair"], "--repair needs --data FILE (batches to measure activation statistics on)"),
    (dict(method="regmean"), ["--method", "regmean"], "--align weights with --method regmean needs --data FILE"),
    (dict(align="none", sketch=8), ["--align", "none", "--sketch", "8"],
     "--sketch sketches weight matching; expected --align weights"),
    (dict(seen_rows=True), ["--seen-rows"], "--seen-rows reads the embedding rows of the tokens in the data"),
    (dict(attention="circuits", method="fisher", data="d.pt"),
     ["--attention", "circuits", "--method", "fisher", "--data", "d.pt"], "--attention circuits merges by averaging"),
]


@pytest.mark.parametrize("fields,flags,said", CASES)
def test_a_config_built_in_python_is_refused_as_the_command_line_is(fields, flags, said, capsys, tmp_path):
    with pytest.raises(InputError) as python:
        MergeConfig(models=["a", "b"], out=str(tmp_path / "o"), **fields)
    assert str(python.value).startswith(said) and "\n" not in str(python.value)
    rc = main(["merge", "a", "b", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("symgraph:") == 1 and "Traceback" not in err, err
    assert " ".join(err.split()) == f"symgraph: {python.value}"  # the same line, word for word
    assert not (tmp_path / "o").exists()


def test_field_errors_are_one_line_too_and_a_valid_config_is_frozen():
    with pytest.raises(InputError, match=r"^--tol 5; expected"):
        MergeConfig(models=["a", "b"], tol=5)
    with pytest.raises(InputError, match="'bogus' is not a merge option; expected only models, out"):
        MergeConfig(models=["a", "b"], bogus=1)
    cfg = MergeConfig(models=["a", "b"], repair=True, data="d.pt")
    with pytest.raises(Exception, match="frozen"):
        cfg.repair = False
    # data given as batches already loaded (run_merge(cfg, data=...)) count as data
    assert build_config(dict(models=["a", "b"], align="activations"), batches=True).align == "activations"
    with pytest.raises(InputError, match="--align activations with --method average needs --data"):
        build_config(dict(models=["a", "b"], align="activations"))


def test_a_yaml_file_is_checked_once_the_command_line_completes_it(tmp_path):
    (tmp_path / "m.yaml").write_text("models: [a, b]\nrepair: true\nout: o\n")
    assert read_merge_config(str(tmp_path / "m.yaml"))["repair"] is True  # not yet complete: no refusal
    cfg = merge_options({"config": str(tmp_path / "m.yaml"), "data": "d.pt"})
    assert cfg.repair and cfg.data == "d.pt"
    with pytest.raises(InputError, match=r"^'repair:' in .*m.yaml needs --data FILE \(batches"):
        merge_options({"config": str(tmp_path / "m.yaml")})


def test_merge_checkpoints_builds_the_same_checked_config(tmp_path):
    L = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)
    for s in (0, 1):
        models.build("llama", seed=s, **L).save_pretrained(tmp_path / f"m{s}")
    paths = [str(tmp_path / "m0"), str(tmp_path / "m1")]
    with pytest.raises(InputError, match=r"^repair needs data \(batches"):  # the keyword, not the flag
        merge_checkpoints(paths, str(tmp_path / "o"), repair=True)
    with pytest.raises(InputError, match="has no parameter 'beta'"):
        merge_checkpoints(paths, str(tmp_path / "o"), method="regmean", parameters={"beta": 1},
                          data=[{"input_ids": torch.zeros(2, 4, dtype=torch.long)}])
    assert not (tmp_path / "o").exists()
    job = merge_checkpoints(paths, str(tmp_path / "o"), align=None, memory_budget="64KB")
    assert job.config.memory_budget == "64KB" and (tmp_path / "o" / "symgraph_merge.json").exists()


def test_symgraph_merge_takes_the_same_config():
    A, B = (models.mlp(s, (6, 16, 12, 3)) for s in (0, 1))
    data = [{"x": torch.randn(8, 6, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    data = [(b["x"],) for b in data]
    cfg = build_config(dict(models=["a", "b"], method="regmean", parameters={"alpha": 0.5}, align="none",
                            weights=[1, 3]), batches=True)
    got = symgraph.merge([A, B], data=data, config=cfg).model.state_dict()
    want = symgraph.merge([A, B], data=data, method="regmean", method_options={"alpha": 0.5}, align=None,
                          weights=[1, 3]).model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    other = symgraph.merge([A, B], data=data, method="regmean", align=None, weights=[1, 3]).model.state_dict()
    assert any(not torch.equal(got[k], other[k]) for k in want)  # alpha 0.5 is not the default's merge
    with pytest.raises(InputError, match=r"takes its options from the config, and method= sets one too"):
        symgraph.merge([A, B], data=data, config=cfg, method="fisher")
    with pytest.raises(InputError, match=r"and refine= sets one too"):
        symgraph.merge([A, B], data=data, config=cfg, refine=3)
    for k, v in dict(method="average", anchor=0, repair=False, untie=False, attention="heads").items():
        with pytest.raises(InputError, match=rf"and {k}= sets one too"):  # at the default's value too
            symgraph.merge([A, B], data=data, config=cfg, **{k: v})
    plain = symgraph.merge([A, B], data[0]).model.state_dict()  # every option the config's default
    spelled = symgraph.merge([A, B], data[0], method="average", anchor=0, repair=False, untie=False, attention="heads",
                             weights=None, method_options=None).model.state_dict()
    assert all(torch.equal(plain[k], spelled[k]) for k in plain)
    with pytest.raises(InputError, match="the config names 2 models and merge\\(\\) was given 3"):
        symgraph.merge([A, B, A], data=data, config=cfg)
    with pytest.raises(InputError, match=r"^the config's merge takes statistics on data .*; expected data="):
        symgraph.merge([A, B], data[0], config=cfg)  # RegMean's Grams, and no batches given

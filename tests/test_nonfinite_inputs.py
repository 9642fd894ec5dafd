"""Models that compute NaN, refused where the NaN arises (issue 60, class 3), through the
``symgraph`` command: a config with a NaN, infinite or negative norm epsilon is refused at load,
naming the field (also when one directory is given twice: never "differ (nan vs nan)"); a model
whose finite weights make an activation overflow is refused by the stage that measures it
(activation statistics of ``--align activations`` and ``compare --data``, the similarity weight
matching solves, REPAIR, ``resize``)
in one line, instead of a solver's traceback or statistics turned into zeros. Exit 2, one
paragraph on stderr, nothing written anywhere (the whole workspace hashed before and after)."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import transformers
import torch
from safetensors.torch import save_file

from symgraph.core.finite import check_config_numbers, same_value
from symgraph.errors import InputError
from symgraph.passes.trace import output_deviation
from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


def _with_field(src, dst, key, value):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    node = cfg
    *path, last = key.split(".")
    for k in path:
        node = node[k]
    node[last] = value
    (dst / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as Python's json writes them


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    inp = root / "inputs"
    (root / "work").mkdir()
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    models.build("bert", seed=0).save_pretrained(inp / "bert")
    for name, key, value in (("nan", "rms_norm_eps", math.nan), ("neg", "rms_norm_eps", -1.0),
                             ("inf_theta", "rope_parameters.rope_theta", math.inf)):
        _with_field(inp / "a", inp / name, key, value)
        _with_field(inp / "b", inp / f"{name}_b", key, value)
    _with_field(inp / "bert", inp / "bert_neg", "layer_norm_eps", -1.0)
    for seed, name in ((0, "big"), (1, "big_b")):  # finite weights whose MLPs overflow float32 (1e50 > 3.4e38)
        m = models.build("llama", seed=seed, **L)
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.up_proj.weight.mul_(1e25)
                layer.mlp.gate_proj.weight.mul_(1e25)
        assert all(torch.isfinite(p).all() for p in m.parameters())
        assert not torch.isfinite(m(torch.randint(0, 64, (2, 12))).logits).all()
        m.save_pretrained(inp / name)
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(inp / "data.safetensors"))
    return root


def _i(name):
    return lambda w: w / "inputs" / name


def _merge(a, b, *extra):
    return lambda w: ["merge", _i(a)(w), _i(b)(w), *[_i(x)(w) if x == "data.safetensors" else x for x in extra],
                      "--out", w / "work" / "o"]


CASES = [
    # a config that makes the model compute NaN: refused at load, naming the field
    ("nan_epsilon", _merge("nan", "nan_b"), ["nan/config.json", "config field 'rms_norm_eps' is nan",
                                             "expected a finite number"]),
    ("nan_epsilon_one_directory_twice", _merge("nan", "nan"), ["config field 'rms_norm_eps' is nan"]),
    ("negative_epsilon", _merge("neg", "neg_b"), ["config field 'rms_norm_eps' is -1.0", "expected a number >= 0"]),
    ("infinite_nested_field", _merge("inf_theta", "inf_theta_b"),
     ["config field 'rope_parameters.rope_theta' is inf", "expected a finite number"]),
    ("negative_layer_norm_eps_analyze", lambda w: ["analyze", _i("bert_neg")(w)],
     ["bert_neg/config.json", "config field 'layer_norm_eps' is -1.0", "expected a number >= 0"]),
    ("nan_epsilon_compare", lambda w: ["compare", _i("nan")(w), _i("nan_b")(w)], ["'rms_norm_eps' is nan"]),
    # finite weights, activations that overflow: refused by the stage that measures them
    ("activation_statistics_merge", _merge("big", "big_b", "--align", "activations", "--data", "data.safetensors"),
     ["activation statistics:", "on batch 0 of the data hold NaN/inf values", "expected a model that computes finite"]),
    ("weight_similarity_merge", _merge("big", "big_b"),
     ["alignment: the similarity matrix of a perm class (48 x 48) holds NaN/inf values"]),
    ("activation_statistics_compare", lambda w: ["compare", _i("big")(w), _i("big_b")(w), "--data",
                                                 _i("data.safetensors")(w)],
     ["activation statistics:", "hold NaN/inf values"]),
    ("repair_statistics", _merge("big", "big_b", "--align", "none", "--repair", "--data", "data.safetensors"),
     ["REPAIR: the channel statistics at 'model.layers.", "hold NaN/inf values"]),
    ("resize_outputs", lambda w: ["resize", _i("big")(w), "--width", "5=64", "--every-layer", "--out",
                                  w / "work" / "o"],
     ["resize: the original model's outputs", "hold NaN/inf values"]),
]


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c[0] for c in CASES])
def test_refusal(ws, case, argv, needles, capsys):
    before = digest(ws)
    r = main_in_process(ws, *argv(ws), capsys=capsys, seconds=120)
    refused(r, *needles)
    assert "differ" not in r.stderr, r.stderr  # never "nan vs nan"
    assert digest(ws) == before  # nothing written (no --out), inputs untouched


def test_config_numbers_named_by_their_path():
    check_config_numbers({"rms_norm_eps": 0.0, "layer_norm_epsilon": 1e-5, "n": [1, 2.5], "rope": {"theta": 1e4}}, "c")
    for cfg, needle in (({"text_config": {"layer_norm_eps": -1e-6}}, "'text_config.layer_norm_eps' is -1e-06"),
                        ({"scales": [1.0, math.inf]}, "'scales[1]' is inf"),
                        ({"x": {"y": [{"z": math.nan}]}}, "'x.y[0].z' is nan")):
        with pytest.raises(InputError, match="config field") as e:
            check_config_numbers(cfg, "cfg.json")
        assert needle in str(e.value), str(e.value)


def test_an_infinity_the_class_defaults_to_is_allowed():
    """Mamba-2's (Bamba's, Falcon-H1's, ...) default ``time_step_limit`` is ``(0.0, inf)``: a
    checkpoint saved with it is read; another infinity, or NaN there, is still refused."""
    default = transformers.Mamba2Config().to_dict()
    assert default["time_step_limit"][1] == math.inf
    check_config_numbers(default, "cfg.json", default)
    for field, value in (("time_step_limit", [0.0, -math.inf]), ("time_step_limit", [0.0, math.nan]),
                         ("layer_norm_epsilon", math.inf)):
        with pytest.raises(InputError, match="config field"):
            check_config_numbers({**default, field: value}, "cfg.json", default)
    with pytest.raises(InputError, match="time_step_limit"):  # without the class's defaults
        check_config_numbers(default, "cfg.json")


def test_mamba2_checkpoint_with_its_default_limit_is_read(tmp_path):
    from symgraph.checkpoints.sharded import Checkpoint
    cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=4, head_dim=8,
                                    state_size=4, n_groups=1, expand=2, chunk_size=8)
    transformers.Mamba2ForCausalLM(cfg).save_pretrained(tmp_path)
    assert Checkpoint(str(tmp_path)).config.time_step_limit[1] == math.inf


def test_nan_equals_nan_in_configs():
    assert same_value({"eps": math.nan, "r": {"t": [math.nan, 1]}}, {"eps": math.nan, "r": {"t": [math.nan, 1]}})
    assert not same_value({"eps": math.nan}, {"eps": 1e-6})
    assert not same_value([1, 2], (1, 2)) and same_value(1, 1.0)


def test_output_deviation_never_zero_on_nan():
    a = [torch.tensor([1.0, 2.0])]
    assert math.isnan(output_deviation(a, [torch.tensor([1.0, math.nan])]))
    assert math.isnan(output_deviation([torch.tensor([math.inf, 2.0])], [torch.tensor([math.inf, 2.0])]))
    assert output_deviation(a, [torch.tensor([1.0, 2.0])]) == 0.0


def test_same_nan_field_is_not_a_difference():
    from transformers import LlamaConfig

    from symgraph.checkpoints.specs import check_same_configs
    nan_a, nan_b, finite = (LlamaConfig(rms_norm_eps=e) for e in (math.nan, math.nan, 1e-6))
    check_same_configs([nan_a, nan_b], ["a", "b"])  # one configuration: nothing differs
    with pytest.raises(InputError, match=r"differ in config field 'rms_norm_eps' \(nan vs 1e-06\)"):
        check_same_configs([nan_a, finite], ["a", "b"])

"""Hostile configs and data through the ``symgraph`` command: a YAML alias bomb ("billion
laughs"), an oversized or too deeply nested config, a key given twice, devices that compute
nothing (``meta``, ``xla``, ``cpu:abc``), data whose ``input_ids`` are a bool mask, floats or
ids outside the vocabulary, a relative model path that exists only in the working directory
(a config's paths are relative to the config file, always), a huge ``--points``, and config
values of the wrong type or size. Each ends in exit 2 and one line naming what was wrong and
what was expected, within seconds; nothing outside ``--out`` changes.

The alias bomb, a device and a working merge run as ``python -m symgraph`` in a subprocess
(with a timeout); the other refusals call the same entry point, ``symgraph.cli.main.main``, in
this process (with an alarm, so a hang fails the test instead of blocking it): a subprocess
each would spend ~3 s importing torch, over a minute for the file on 2 cores."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from symgraph.testing import models

from cli_helpers import ENV, digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)

BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + BOMB + "models: *i\n"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws4")
    inp, cfg = root / "inputs", root / "configs"
    (root / "work").mkdir()
    cfg.mkdir()
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    for name, x in (("data", ids), ("bool", ids > 30), ("float", ids.float()), ("over", ids.clone().fill_(64)),
                    ("negative", ids - 1)):
        save_file({"input_ids": x}, str(inp / f"{name}.safetensors"))
    a, b = inp / "a", inp / "b"
    configs = {
        "bomb": BOMB,
        "huge": "models: [a, b]\n" + "# padding\n" * 110_000,  # over 1 MiB
        "deep": "models: " + "[" * 5000 + "]" * 5000 + "\n",
        "twice": f"models: [{a}, {b}]\nmodels: [{b}, {a}]\nout: o\n",
        "device_xla": f"models: [{a}, {b}]\ndevice: xla\nout: o\n",
        "device_meta": f"models: [{a}, {b}]\ndevice: meta\nout: o\n",
        "null_refine": f"models: [{a}, {b}]\nrefine: null\nout: o\n",
        "negative_sketch": f"models: [{a}, {b}]\nsketch: -4\nout: o\n",
        "float_refine": f"models: [{a}, {b}]\nrefine: 2.5\nout: o\n",
        "string_models": f"models: {a} {b}\nout: o\n",
        "string_outputs": f"models: [{a}, {b}]\noutputs: logits\nout: o\n",
        "huge_refine": f"models: [{a}, {b}]\nrefine: {10 ** 12}\ndata: {inp / 'data.safetensors'}\nout: o\n",
        "huge_int": f"models: [{a}, {b}]\nsketch: {'9' * 5000}\nout: o\n",
        "mergekit_parameters": "merge_method: linear\nparameters: [1]\nmodels: [{model: a}, {model: b}]\n",
        # relative paths: beside the config only ('a' and 'b' exist in inputs/, not in configs/)
        "rel_models": "models: [a, b]\nout: o\n",
        "rel_missing_path": "models: [./a, ../inputs/b]\nout: o\n",
        "rel_data": "models: [../inputs/a, ../inputs/b]\nalign: activations\ndata: data.safetensors\nout: o\n",
    }
    for name, text in configs.items():
        (cfg / f"{name}.yaml").write_text(text)
    (inp / "beside.yaml").write_text("models: [a, b]\nalign: none\n")  # relative paths that are there
    return root


def run(ws, *args, cwd="work", timeout=300):
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ws / cwd, timeout=timeout)


I, C = "inputs", "configs"  # noqa: E741


def _merge(*extra):
    return lambda w: ["merge", w / I / "a", w / I / "b", *extra, "--out", w / "work" / "o"]


def _data(name):
    return _merge("--align", "activations", "--data", f"../{I}/{name}.safetensors")


def _config(name):
    return lambda w: ["merge", "--config", w / C / f"{name}.yaml"]


CASES = [
    # 1. YAML bounded: no aliases, at most 1 MiB, nesting bounded, each key once
    ("yaml_alias_bomb", _config("bomb"), ["uses a YAML alias (*a, line 2)", "no anchors (&name) or aliases"]),
    ("yaml_over_1mib", _config("huge"), ["huge.yaml' is over 1 MiB", "at most 1 MiB"]),
    ("yaml_nested_too_deep", _config("deep"), ["nests values more than 32 deep"]),
    ("yaml_key_twice", _config("twice"), ["gives the key 'models' twice (line 2)", "each key once"]),
    # 2. devices that compute nothing
    ("device_meta", _merge("--device", "meta"), ["--device 'meta'", "meta tensors hold no values",
                                                 "expected 'cpu', 'cuda' or 'cuda:N'"]),
    ("device_not_a_name", _merge("--device", "cpu:abc"), ["--device 'cpu:abc'", "is not a device name"]),
    ("device_xla", _merge("--device", "xla"), ["--device 'xla'", "cannot hold a tensor", "expected 'cpu', 'cuda'"]),
    ("device_hpu", _merge("--device", "hpu"), ["--device 'hpu'", "cannot hold a tensor"]),  # no torch.hpu module
    ("device_xla_in_config", _config("device_xla"), ["key 'device' is 'xla'", "expected 'cpu', 'cuda'"]),
    ("device_meta_in_config", _config("device_meta"), ["key 'device' is 'meta'", "meta tensors hold no values"]),
    # 3. data files: integer ids inside the vocabulary
    ("data_bool_mask", _data("bool"), ["bool.safetensors", "dtype bool (a bool mask)", "expected an integer tensor"]),
    ("data_float_ids", _data("float"), ["float.safetensors", "dtype float32", "expected an integer tensor"]),
    ("data_ids_over_vocab", _data("over"), ["over.safetensors", "range over [64, 64]", "expected ids in [0, 63]"]),
    ("data_negative_ids", _data("negative"), ["negative.safetensors", "range over [-1,", "expected ids in [0, 63]"]),
    # 4. a config's relative paths are relative to the config file, never to the working directory
    ("config_model_only_in_working_directory", lambda w: ["merge", "--config", w / C / "rel_models.yaml"],
     ["rel_models.yaml", "model 'a' is not beside the config", "relative to the config file"]),
    ("config_relative_path_missing", lambda w: ["merge", "--config", w / C / "rel_missing_path.yaml"],
     ["rel_missing_path.yaml", "model './a' does not exist", f"{C}/a'", "relative to the config file"]),
    ("config_relative_data_missing", lambda w: ["merge", "--config", w / C / "rel_data.yaml"],
     ["rel_data.yaml", "data 'data.safetensors' does not exist", f"{C}/data.safetensors'"]),
    # 5. barrier's --points named with its range
    ("barrier_huge_points", lambda w: ["barrier", w / I / "a", w / I / "b", "--data", w / I / "data.safetensors",
                                       "--points", 10 ** 12], ["--points 1000000000000", "at most 1001"]),
    # 6. config values of the wrong type or size, named by key
    ("config_null_refine", _config("null_refine"), ["key 'refine' is None", "an integer >= 0"]),
    ("config_negative_sketch", _config("negative_sketch"), ["key 'sketch' is -4", "expected 0 (exact) to 1048576 projection columns"]),
    ("config_float_refine", _config("float_refine"), ["key 'refine' is 2.5 (float)", "an integer >= 0"]),
    ("config_string_for_a_list", _config("string_models"), ["key 'models' is", "(str); expected a list"]),
    ("config_string_outputs", _config("string_outputs"), ["key 'outputs' is 'logits' (str)", "a list of output"]),
    ("config_huge_refine", _config("huge_refine"), ["key 'refine' is 1000000000000", "at most 1000000"]),
    ("config_5000_digit_number", _config("huge_int"), ["huge_int.yaml' holds a value that cannot be read"]),
    ("mergekit_parameters_a_list", _config("mergekit_parameters"), ["parameters is [1] (list)", "a mapping"]),
]


SUBPROCESS = {"yaml_alias_bomb", "device_meta"}  # through `python -m symgraph` itself


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_refusal(ws, case, argv, needles, capsys):
    before = digest(ws)
    cwd = I if case == "config_model_only_in_working_directory" else "work"  # where 'a' and 'b' are
    t0 = time.perf_counter()
    if case in SUBPROCESS:
        r = run(ws, *argv(ws), cwd=cwd, timeout=60)  # the alias bomb used to run until killed
    else:
        r = main_in_process(ws, *argv(ws), cwd=cwd, capsys=capsys)
    refused(r, *needles)
    assert time.perf_counter() - t0 < 60, case
    assert digest(ws) == before


@pytest.mark.slow
def test_config_paths_beside_the_config_merge_from_any_working_directory(ws, tmp_path):
    r = run(ws, "merge", "--config", ws / I / "beside.yaml", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-2000:]
    inputs = json.loads((tmp_path / "o" / "symgraph_merge.json").read_text())["inputs"]
    assert inputs == [str(ws / I / "a"), str(ws / I / "b")]

"""Numeric options bounded by the schema (issue 60, class 5): every budget, duration, count and
seed is parsed by its one declaration with a finite range (``MergeConfig`` / ``AlignOptions``
fields, :class:`symgraph.core.schema.Number` for the other commands' options), and a value
outside it (infinite, NaN, negative, 64-bit, 10**23) is refused in one line naming the option
(its flag, or its YAML key) and the range: exit 2, nothing written, inputs untouched."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from symgraph.alignment.compare import check_options
from symgraph.cli.demo import run_demo
from symgraph.errors import InputError
from symgraph.width.resize import resize
from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    inp, cfg = root / "inputs", root / "configs"
    (root / "work").mkdir()
    cfg.mkdir()
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    save_file({"input_ids": torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))},
              str(inp / "data.safetensors"))
    a, b = inp / "a", inp / "b"
    for name, text in {"inf_budget": "memory_budget: infGB", "huge_budget": "memory_budget: 1e999GB",
                       "nan_weights": "weights: [.nan, 1]", "inf_weights": "weights: [.inf, 1]",
                       "huge_sweeps": "max_iter: 100000000000"}.items():
        (cfg / f"{name}.yaml").write_text(f"models: [{a}, {b}]\n{text}\nout: o\n")
    return root


def _merge(*extra):
    return lambda w: ["merge", w / "inputs" / "a", w / "inputs" / "b", *extra, "--out", w / "work" / "o"]


def _config(name):
    return lambda w: ["merge", "--config", w / "configs" / f"{name}.yaml"]


BUDGET = "expected a size such as '2GB' or '500MB'"
CASES = [
    ("memory_budget_1e999", _merge("--memory-budget", "1e999GB"), ["--memory-budget '1e999GB'", "from 1B to 1000000GB",
                                                                     BUDGET]),
    ("memory_budget_nan", _merge("--memory-budget", "nanGB"), ["--memory-budget 'nanGB'", "from 1B to 1000000GB"]),
    ("memory_budget_over_range", _merge("--memory-budget", "2000000GB"), ["--memory-budget '2000000GB'",
                                                                           "from 1B to 1000000GB"]),
    ("memory_budget_inf_in_yaml", _config("inf_budget"), ["key 'memory_budget' is 'infGB'", "from 1B to 1000000GB"]),
    ("memory_budget_1e999_in_yaml", _config("huge_budget"), ["key 'memory_budget' is '1e999GB'"]),
    ("weights_inf_flag", _merge("--weights", "inf", "1"), ["--weights [inf, 1.0]", "a list of numbers, one per model, each finite"]),
    ("weights_nan_in_yaml", _config("nan_weights"), ["key 'weights' is [nan, 1]", "a list of numbers, one per model, each finite"]),
    ("weights_inf_in_yaml", _config("inf_weights"), ["key 'weights' is [inf, 1]", "a list of numbers, one per model, each finite"]),
    ("max_iter_huge", _merge("--max-iter", "100000000000"), ["--max-iter 100000000000", "at most 1000"]),
    ("max_iter_huge_in_yaml", _config("huge_sweeps"), ["key 'max_iter' is 100000000000", "at most 1000"]),
    ("sketch_huge", _merge("--sketch", str(10 ** 23)), [f"--sketch {10 ** 23}", "to 1048576"]),
    ("demo_seconds_inf", lambda w: ["demo", "--seconds", "inf", "--out", w / "work" / "d"],
     ["--seconds inf", "above 0 and at most 86400"]),
    ("demo_seconds_1e999", lambda w: ["demo", "--seconds", "1e999", "--out", w / "work" / "d"], ["--seconds inf"]),
    ("demo_seconds_nan", lambda w: ["demo", "--seconds", "nan", "--out", w / "work" / "d"],
     ["--seconds nan", "a training budget in seconds, above 0 and at most 86400"]),
    ("demo_seconds_negative", lambda w: ["demo", "--seconds", "-1", "--out", w / "work" / "d"], ["--seconds -1.0"]),
    ("compare_null_10_23", lambda w: ["compare", w / "inputs" / "a", w / "inputs" / "b", "--null", str(10 ** 23)],
     [f"--null {10 ** 23}", "an integer from 0 to 1000"]),
    ("compare_seed_64_bit", lambda w: ["compare", w / "inputs" / "a", w / "inputs" / "b", "--seed", str(2 ** 64)],
     [f"--seed {2 ** 64}", "an integer from 0 to 2**32 - 1"]),
    ("resize_seed_64_bit", lambda w: ["resize", w / "inputs" / "a", "--width", "5=64", "--seed", str(2 ** 64),
                                      "--out", w / "work" / "o"], [f"--seed {2 ** 64}", "from 0 to 2**32 - 1"]),
    ("resize_seed_negative", lambda w: ["resize", w / "inputs" / "a", "--width", "5=64", "--seed", "-1",
                                        "--out", w / "work" / "o"], ["--seed -1", "from 0 to 2**32 - 1"]),
    ("rotate_seed_64_bit", lambda w: ["rotate", w / "inputs" / "a", "--seed", str(2 ** 64), "--out", w / "work" / "o"],
     [f"--seed {2 ** 64}", "from 0 to 2**32 - 1"]),
    ("barrier_points_huge", lambda w: ["barrier", w / "inputs" / "a", w / "inputs" / "b", "--data",
                                       w / "inputs" / "data.safetensors", "--points", str(10 ** 23)],
     [f"--points {10 ** 23}", "at most 1001"]),
]


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c[0] for c in CASES])
def test_refusal(ws, case, argv, needles, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SYMGRAPH_CACHE", str(tmp_path / "cache"))  # demo: no training may start
    before = digest(ws)
    r = main_in_process(ws, *argv(ws), capsys=capsys, seconds=60)
    refused(r, *needles)
    assert "Traceback" not in r.stderr and "OverflowError" not in r.stderr
    assert digest(ws) == before
    assert not (tmp_path / "cache").exists()


def test_library_entry_points_take_the_same_bounds(tmp_path):
    for bad in (math.inf, math.nan, -1, 0, 1e6):
        with pytest.raises(InputError, match=r"seconds= .*above 0 and at most 86400"):
            run_demo(out=str(tmp_path / "d"), seconds=bad)
    assert not (tmp_path / "d").exists()
    for bad in (10 ** 23, -1, 2.5, True):
        with pytest.raises(InputError, match=r"null= .*an integer from 0 to 1000"):
            check_options(bad, 0.25)
    check_options(0, 0.25)
    check_options(1000, 0.25)  # the bounds themselves are taken
    m = models.build("llama", seed=0, **L)
    with pytest.raises(InputError, match=r"seed= 18446744073709551616; expected a seed"):
        resize(m, {5: 64}, seed=2 ** 64)


def test_sizes_in_every_unit_and_bare_bytes():
    from symgraph.checkpoints.sharded import parse_size
    from symgraph.errors import InputError
    assert [parse_size(s) for s in ("1TB", "2TiB", "100", "1e3", "1.5kB", "2GB")] == [
        10 ** 12, 2 << 40, 100, 1000, 1500, 2 * 10 ** 9]
    for bad in ("abc", "0", "-1", "GB", "inf", "nanMB"):
        with pytest.raises(InputError, match="a bare number is bytes"):
            parse_size(bad)

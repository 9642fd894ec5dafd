"""``symgraph align``, ``barrier`` and ``compare`` derive their flags from schemas whose shared
fields are ``MergeConfig``'s (symgraph.app.commands): the same choices, defaults, metavars and
help as ``symgraph merge``'s flags, the same one-line refusal of a bad value, and the options
reach the engine (recorded, and the alignment is the engine's with them)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from symgraph.app.commands import AlignCommand, BarrierCommand, CompareCommand
from symgraph.cli.main import build_parser
from symgraph.merging.config import MergeConfig
from symgraph.testing.models import build

from cli_helpers import main_in_process, refused

SCHEMAS = {"align": AlignCommand, "barrier": BarrierCommand, "compare": CompareCommand}
#: The options each command shares with merge, at the least.
SHARED = {"data", "fold_norms", "device", "memory_budget", "sketch", "out", "force"}
#: The shared options a command words or types as its own (barrier's --align takes several, ...).
OWN = {"align": {"align", "out", "device"}, "barrier": {"align", "data", "attention", "out", "device"},
       "compare": {"data", "out", "device"}}


def _actions(command: str) -> dict:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("command", sorted(SCHEMAS))
def test_shared_flags_are_merges(command):
    merge, mine, schema = _actions("merge"), _actions(command), SCHEMAS[command]
    assert SHARED <= set(schema.model_fields), sorted(SHARED - set(schema.model_fields))
    shared = [k for k in schema.model_fields if k in MergeConfig.model_fields]
    assert len(shared) >= len(SHARED)
    for key in shared:
        f, g = schema.model_fields[key], MergeConfig.model_fields[key]
        if key == "align":  # each command's own: barrier's several, align's without none
            continue
        assert f.json_schema_extra["expected"] == g.json_schema_extra["expected"], key
        assert (f.annotation, f.metadata) == (g.annotation, g.metadata), key
        if key in OWN[command]:  # in its own words, or required
            continue
        assert (f.default, f.annotation, f.metadata, f.description) == (g.default, g.annotation, g.metadata,
                                                                         g.description), key
        flag = next(s for s, a in mine.items() if a.dest == key)
        a, b = mine[flag], merge[flag]
        assert (a.choices, a.default, a.type, a.nargs, a.metavar, a.const, a.help) == \
            (b.choices, b.default, b.type, b.nargs, b.metavar, b.const, b.help), (command, flag)


def test_a_commands_own_align_says_how_it_differs():
    assert _actions("barrier")["--align"].choices == ("none", "weights", "activations")
    assert _actions("barrier")["--align"].nargs == "+"
    assert BarrierCommand(data="d").align == ["none", "weights", "activations"]
    assert _actions("align")["--align"].choices == ("weights", "activations")
    assert _actions("align")["--out"].required and _actions("barrier")["--data"].required
    assert "--align" not in _actions("compare")


BAD = [("--memory-budget", "0GB", "--memory-budget '0GB': is not a size from 1B to 1000000GB"),
       ("--memory-budget", "lots", "--memory-budget 'lots': is not a size"),
       ("--device", "nonsense", "--device 'nonsense': is not a device name; expected 'cpu', 'cuda' or 'cuda:N'"),
       ("--device", "meta", "--device 'meta': is not a device symgraph computes on"),
       ("--sketch", "-1", "--sketch -1; expected 0 (exact) to 1048576 projection columns")]


@pytest.mark.parametrize("flag,value,needle", BAD)
def test_a_bad_engine_value_is_refused_in_merges_one_line(tmp_path, capsys, flag, value, needle):
    (tmp_path / "work").mkdir()
    lines = {}
    for command in ("merge", "align", "barrier", "compare"):
        r = main_in_process(tmp_path, command, "a", "b", "--out", "o", "--data", "d.safetensors", flag, value,
                            capsys=capsys)
        refused(r, needle)  # exit 2, one paragraph (wrapped at 100 columns), no traceback
        lines[command] = " ".join(r.stderr.split())
    assert len(set(lines.values())) == 1, lines
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (["align", "--sketch", "8", "--align", "activations", "--data", "d"], "--sketch sketches weight matching; "
     "expected --align weights"),
    (["align", "--align", "activations"], "--align activations needs --data FILE"),
    (["align", "--max-iter", "0"], "--max-iter 0; expected a number of sweeps"),
    (["barrier", "--data", "d", "--align", "none", "--max-iter", "3"], "--max-iter ends the sweeps of an alignment"),
    (["barrier", "--data", "d", "--align", "activations", "--tol", "0.1"], "--tol ends the sweeps of weight matching"),
    (["barrier", "--data", "d", "--align", "weights", "--align-data", "e"], "--align-data is the data of activation"),
    (["barrier", "--data", "d", "--attention", "circuits", "--out-of-core"], "--attention circuits draws the line "
     "in memory, and --out-of-core run(s) it out of core"),
    (["barrier", "--data", "d", "--attention", "circuits", "--memory-budget", "1MB"], "and --memory-budget run(s)"),
    (["barrier", "--data", "d", "--points", "2"], "--points 2; expected at least 3 and at most 1001"),
    (["compare", "--data", "d", "--sketch", "8"], "--sketch sketches weight matching, and with --data compare"),
    (["compare", "--null", "-1"], "--null -1; expected a number of shuffled copies"),
    (["compare", "--seed", "-1"], "--seed -1; expected a seed"),
])
def test_the_rules_between_a_commands_options(tmp_path, capsys, args, needle):
    (tmp_path / "work").mkdir()
    r = main_in_process(tmp_path, args[0], "a", "b", "--out", "o", *args[1:], capsys=capsys)
    refused(r, needle)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    shape = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
    for seed in (0, 1):
        build("llama", seed=seed, **shape).save_pretrained(d / f"m{seed}")
    save_file({"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))},
              str(d / "data.safetensors"))
    (d / "work").mkdir()
    return d


def test_align_takes_the_engine_options(pair, capsys):
    from safetensors.torch import load_file

    from symgraph.alignment.saved import ALIGNMENT_FILE, save_alignment
    from symgraph.merging.streaming import StreamingMerge
    opts = ["--max-iter", "1", "--until", "exact", "--memory-budget", "256KB", "--full-groups"]
    r = main_in_process(pair, "align", pair / "m0", pair / "m1", "--out", pair / "al", *opts, capsys=capsys)
    assert r.returncode == 0, r.stderr
    rec = json.loads((pair / "al" / "symgraph_align.json").read_text())["symgraph_align"]
    assert (rec["max_iter"], rec["until"], rec["memory_budget"], rec["full_groups"]) == (1, "exact", "256KB", True)
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], align="weights", max_iter=1, until="exact",
                         memory_budget="256KB", full_groups=True)
    save_alignment(job.align()[1], str(pair / "want.safetensors"))
    got, want = load_file(str(pair / "al" / ALIGNMENT_FILE)), load_file(str(pair / "want.safetensors"))
    assert sorted(got) == sorted(want) and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_barrier_and_compare_run_out_of_core_with_a_budget(pair, capsys):
    r = main_in_process(pair, "barrier", pair / "m0", pair / "m1", "--data", pair / "data.safetensors", "--align",
                        "none", "weights", "--points", "3", "--memory-budget", "1MB", "--sketch", "4", "--out",
                        pair / "b", capsys=capsys, seconds=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads((pair / "b" / "barrier.json").read_text())
    assert rec["mode"] == "out of core" and rec["options"] == {"memory_budget": "1MB", "sketch": 4}
    r = main_in_process(pair, "compare", pair / "m0", pair / "m1", "--null", "0", "--memory-budget", "1MB",
                        "--out", pair / "c", capsys=capsys, seconds=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((pair / "c" / "compare.json").read_text())["mode"] == "out of core"
    r = main_in_process(pair, "compare", "tiny-llama", "tiny-llama", "--null", "0", "--memory-budget", "1MB",
                        capsys=capsys)
    refused(r, "--memory-budget set the out-of-core engine")
    r = main_in_process(pair, "barrier", "tiny-llama", "tiny-llama", "--data", pair / "data.safetensors",
                        "--memory-budget", "1MB", capsys=capsys)
    refused(r, "--memory-budget set the out-of-core engine, and the models are loaded")

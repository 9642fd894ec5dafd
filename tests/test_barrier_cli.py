"""``symgraph barrier A B --data F``: the loss along the line between two models, with and
without alignment, as a table, JSON and a plot."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import symgraph
from symgraph.alignment.refine import default_loss
from symgraph.checkpoints.specs import load_data
from symgraph.testing import models

from conftest import cli

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("barrier")
    for s in (0, 1):
        models.build("llama", seed=s, **L).save_pretrained(root / f"m{s}")
    models.build("gpt2", vocab=64, hidden=32, layers=2, heads=4, positions=64).save_pretrained(root / "g")
    save_file({"input_ids": torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))},
              str(root / "data.safetensors"))
    return root


@pytest.mark.slow
def test_barrier_table_json_and_plot_match_the_library(pair, tmp_path):
    r = cli("barrier", pair / "m0", pair / "m1", "--data", pair / "data.safetensors", "--align", "none", "weights",
            "--out-of-core", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "o" / "barrier.json").read_text())
    assert [row["align"] for row in rec["rows"]] == ["none", "weights"] and "weights" in r.stdout
    assert rec["mode"] == "out of core"  # --out-of-core: nothing loaded whole
    assert (tmp_path / "o" / "barrier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    A, B = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    data = load_data(str(pair / "data.safetensors"), A)

    def loss(m):
        with torch.no_grad():
            return float(sum(float(default_loss(m, b)) for b in data) / len(data))
    for row, Bal in zip(rec["rows"], (B, symgraph.align(A, B).apply(B))):
        curve = symgraph.interpolate(A, Bal, np.linspace(0, 1, 11), loss)
        assert row["barrier"] == pytest.approx(symgraph.loss_barrier(curve), abs=1e-5)
        assert [lam for lam, _ in row["curve"]] == pytest.approx([lam for lam, _ in curve])
    ends = dict(rec["rows"][0]["curve"])
    assert ends[1.0] == pytest.approx(loss(A), abs=1e-5) and ends[0.0] == pytest.approx(loss(B), abs=1e-5)


@pytest.mark.slow  # 35 s on 2 cores; the default suite took 618 s at b6d003a (budget 600 s); test_barrier_table_json_and_plot_match_the_library keeps the command in the default run
def test_out_of_core_curves_equal_the_in_memory_ones(pair):
    """The streamed line (the model's own program run op by op on interpolated tensors read
    from the checkpoints) gives the in-memory losses, for each alignment, with the same
    alignment applied in memory."""
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.cli.barrier import streamed_barrier_curves
    A, B = models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)
    data = load_data(str(pair / "data.safetensors"), A)[:2]
    ca, cb = Checkpoint(str(pair / "m0")), Checkpoint(str(pair / "m1"))
    rows = streamed_barrier_curves(ca, cb, data, ("none", "weights", "activations"), points=3)

    def loss(m):
        with torch.no_grad():
            return float(sum(float(default_loss(m, b)) for b in data) / len(data))
    from symgraph.merging.streaming import StreamingMerge
    for row in rows:
        Bal = B
        if row["align"] != "none":
            job = StreamingMerge([ca, cb], align=row["align"], data=data if row["align"] == "activations" else None)
            job.align()
            Bal = job.alignments[1].apply(B, template=A)
        want = symgraph.interpolate(A, Bal, np.linspace(0, 1, 3), loss)
        assert [x for _, x in row["curve"]] == pytest.approx([x for _, x in want], abs=1e-5), row["align"]
    assert rows[1]["barrier"] < rows[0]["barrier"]


@pytest.mark.parametrize("extra,needle", [(["--points", "2"], "at least 3"),
                                          (["--align", "nonsense"], "invalid choice")])
@pytest.mark.slow
def test_barrier_refuses_bad_options_in_one_line(pair, extra, needle):
    r = cli("barrier", pair / "m0", pair / "m1", "--data", pair / "data.safetensors", *extra)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_barrier_refuses_two_architectures(pair, tmp_path):
    r = cli("barrier", pair / "m0", pair / "g", "--data", pair / "data.safetensors", "--out", tmp_path / "o")
    assert r.returncode == 2 and "LlamaForCausalLM" in r.stderr and "GPT2LMHeadModel" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("out_of_core", [False, True])
def test_barrier_refuses_configs_that_change_the_function(pair, tmp_path, out_of_core):
    """Every point of the line runs in A's config: B's other norm epsilon would be dropped and
    its end of the curve would not be B. Refused on both paths, and by ``symgraph.interpolate``."""
    eps = tmp_path / "eps"
    b = models.build("llama", seed=1, **L)
    b.config.rms_norm_eps = 1e-2
    b.save_pretrained(eps)
    r = cli("barrier", pair / "m0", eps, "--data", pair / "data.safetensors", *(["--out-of-core"] * out_of_core))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "differ in config field 'rms_norm_eps' (1e-06 vs 0.01)" in " ".join(r.stderr.split())
    if not out_of_core:
        with pytest.raises(symgraph.InputError, match=r"^'a' and 'b' differ in config field 'rms_norm_eps'"):
            symgraph.interpolate(models.build("llama", seed=0, **L), b, loss_fn=lambda m: 0.0)


@pytest.mark.slow  # trains the demo's two models (a few seconds each)
def test_barrier_on_the_demo_pair_reproduces_the_demos_table(tmp_path, monkeypatch):
    from symgraph.cli import demo
    monkeypatch.setenv("SYMGRAPH_CACHE", str(tmp_path / "cache"))
    rows = demo.run_demo(out=str(tmp_path / "demo"), seconds=6)
    train, held = demo.corpus()
    save_file({"input_ids": torch.cat(demo.batches(held, 4, 16, seed=123))}, str(tmp_path / "held.safetensors"))
    save_file({"input_ids": torch.cat(demo.batches(train, 8, 8, seed=7))}, str(tmp_path / "train.safetensors"))
    root = tmp_path / "cache" / demo.CACHE_VERSION
    r = cli("barrier", root / "seed0", root / "seed1", "--data", tmp_path / "held.safetensors", "--align-data",
            tmp_path / "train.safetensors", "--points", "21", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-2000:]
    got = {row["align"]: row for row in json.loads((tmp_path / "o" / "barrier.json").read_text())["rows"]}
    for name, l05, barrier, _, _ in rows:
        assert got[name]["barrier"] == pytest.approx(barrier, abs=1e-4), name
        assert got[name]["midpoint"] == pytest.approx(l05, abs=1e-4), name

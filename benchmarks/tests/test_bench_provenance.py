"""The provenance benchmark's copies section (:mod:`benchmarks.provenance_families`): a
transformed copy of a tested family, saved and compared as ``symgraph compare`` compares it
(in memory and out of core), is "same", and the recovered element applied gives A to 1e-6; a
family that fails is a row with its reason."""
from __future__ import annotations

import pytest
import torch

from benchmarks.families import FAMILIES, build
from benchmarks.provenance_families import TARGET, families_markdown, family_row, run_families


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# llama (11 s) slow: gpt2 keeps the path in the default suite, the benchmark runs all 22
@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_a_transformed_copy_of_a_family_is_the_same(name):
    row = family_row(name)
    assert row["ok"] and row["reason"] is None, row
    assert row["verdict"] == row["ooc_verdict"] == "same"
    assert row["mode"] == "in memory" and row["ooc_mode"] == "out of core"
    assert row["error"] < TARGET and row["ooc_error"] < TARGET
    assert row["moved"] > 0.1  # the copy was moved before it was recovered
    assert {"perm", "gl"} <= set(row["kinds"])


def test_the_section_lists_every_family_and_a_failure_with_its_reason(monkeypatch):
    assert len(FAMILIES) == 22 and len(set(FAMILIES)) == 22
    import benchmarks.provenance_families as pf

    def broken(name, seed=0):
        raise RuntimeError("cannot build it")
    monkeypatch.setattr(pf, "build", broken)
    f = run_families(["gpt2"], out_of_core=False)
    (row,) = f["rows"]
    assert not row["ok"] and row["reason"] == "RuntimeError: cannot build it"
    assert (f["families"], f["same_in_memory"], f["passed"]) == (1, 0, 0)
    md = families_markdown(f)
    assert "| gpt2 | error |" in md and "- gpt2: RuntimeError: cannot build it" in md and "0/1 families" in md


def test_build_is_the_tests_model():
    a, b = build("qwen2"), build("qwen2")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="unknown family"):
        build("nope")


def test_a_checkpoint_moved_out_of_core_is_a_transformed_copy(tmp_path):
    """``bench_provenance_scale.write_moved``: a checkpoint moved by a random full-group element
    tensor by tensor, which ``compare --out-of-core`` calls the same model."""
    from benchmarks.bench_provenance_scale import write_moved
    from symgraph.cli.compare import compare_paths
    from symgraph.testing import models
    models.build("llama", seed=0, vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48,
                 positions=64).save_pretrained(tmp_path / "a")
    write_moved(str(tmp_path / "a"), str(tmp_path / "m"), work=torch.float64)
    from safetensors.torch import load_file
    a, m = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "m"))
    k = "model.layers.0.self_attn.q_proj.weight"
    assert a.keys() == m.keys() and float((a[k] - m[k]).norm() / a[k].norm()) > 0.1  # it moved
    res = compare_paths(str(tmp_path / "a"), str(tmp_path / "m"), null=0, out_of_core=True)
    assert res.mode == "out of core" and res.verdict == "same" and res.max_rel_distance < 1e-6

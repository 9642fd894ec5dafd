"""``symgraph compare A B``: a transformed copy is "same", a fine-tuned and transformed copy
"derived", an independently initialised model "unrelated"; different architectures and a
checkpoint missing a tensor are refused in one line (exit 2). The commands run through the
command's entry point in this process (as the docs examples do): tiny models, seconds."""
from __future__ import annotations

import copy
import json

import pytest
from safetensors.torch import load_file, save_file

import symgraph
from symgraph.cli.main import main
from symgraph.testing import models

from conftest import successor_sampler

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


def _moved(model, seed):
    """``model`` moved by a random element of every group (the full groups, not only their
    orthogonal part)."""
    return symgraph.transform(model, symgraph.analyze(model).random_transform(seed=seed))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    A = models.build("llama", seed=0, **L)
    A.save_pretrained(root / "a")
    _moved(A, 1).save_pretrained(root / "copy")
    tuned = copy.deepcopy(A)
    models.train(tuned, successor_sampler(7), steps=15, lr=3e-3)
    _moved(tuned, 2).save_pretrained(root / "tuned")
    _moved(models.build("llama", seed=5, **L), 3).save_pretrained(root / "other")
    models.build("gpt2", vocab=64, hidden=32, layers=2, heads=4, positions=64).save_pretrained(root / "gpt2")
    (root / "holed").mkdir()
    for f in (root / "a").iterdir():
        (root / "holed" / f.name).write_bytes(f.read_bytes())
    state = load_file(str(root / "a" / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(root / "holed" / "model.safetensors"), metadata={"format": "pt"})
    return root


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_transformed_copy_is_the_same(dirs, capsys):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "copy", "--json")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["verdict"] == "same"
    assert rec["max_rel_distance"] < 1e-6
    assert all(t["rel_distance"] < 1e-6 for t in rec["tensors"])
    assert {"orthogonal", "gl", "perm"} <= set(rec["group_kinds"])
    # the recovered element applied to B gives A
    A = models.build("llama", seed=0, **L)
    B = _moved(A, 1)
    res = symgraph.compare(A, B)
    got, want = res.alignment.apply(B).state_dict(), A.state_dict()
    assert max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want) < 1e-6


def test_a_fine_tuned_copy_is_derived_with_a_plot(dirs, capsys, tmp_path):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "tuned", "--null", "2", "--out", tmp_path / "o")
    assert rc == 0, err
    assert out.startswith("verdict: derived") and "carried by" in out
    rec = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert rec["verdict"] == "derived" and rec["excess"] >= rec["threshold"] and rec["p_value"] < rec["alpha"]
    assert rec["max_rel_distance"] > 1e-3 and len(rec["null"]) == 2
    assert {t["name"] for t in rec["tensors"]} >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert rec["carriers"] and all(r["correlation"] > rec["null_mean"] for r in rec["layers"] if r["carries"])
    assert (tmp_path / "o" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_independent_model_is_unrelated(dirs, capsys):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "other", "--null", "2", "--json")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["verdict"] == "unrelated" and rec["excess"] < rec["threshold"]


@pytest.mark.parametrize("other,words", [("gpt2", "architecture"), ("holed", "up_proj")])
def test_refusals_are_one_line(dirs, capsys, other, words):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / other)
    assert rc == 2 and out == ""
    lines = err.rstrip("\n").splitlines()  # one refusal, wrapped as one paragraph
    assert lines[0].startswith("symgraph: ") and all(ln.startswith("  ") for ln in lines[1:]), err
    assert "Traceback" not in err and words in " ".join(err.split()), err


def test_python_refuses_models_of_different_shapes():
    with pytest.raises(symgraph.InputError, match="differ in tensor"):
        symgraph.compare(models.build("llama", **L), models.build("llama", **{**L, "vocab": 48}))


@pytest.mark.slow
def test_by_activations_a_copy_is_the_same_and_a_stranger_unrelated(dirs, capsys, tmp_path):
    import torch
    save_file({"input_ids": torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))},
              str(tmp_path / "data.safetensors"))
    for other, verdict in (("copy", "same"), ("other", "unrelated")):
        rc, out, err = _run(capsys, "compare", dirs / "a", dirs / other, "--data", tmp_path / "data.safetensors",
                            "--null", "2", "--json")
        assert rc == 0, err
        rec = json.loads(out)
        assert rec["verdict"] == verdict and rec["similarity"] == "activations", rec["verdict"]


@pytest.mark.slow  # 14 s; the command out of core (test_the_command_compares_out_of_core) runs by default
def test_out_of_core_gives_the_in_memory_numbers(dirs):
    """``--out-of-core`` (the merge engine's alignment, B read into A's basis tensor by tensor,
    the null's shuffled copies read the same way): the verdicts, the null and every per-tensor
    number of the in-memory comparison (float32: float64 solves on both paths)."""
    from symgraph.cli.compare import compare_paths
    for other, null in (("tuned", 1), ("copy", 0)):
        mem = compare_paths(str(dirs / "a"), str(dirs / other), null=null, out_of_core=False)
        ooc = compare_paths(str(dirs / "a"), str(dirs / other), null=null, out_of_core=True)
        assert (mem.mode, ooc.mode) == ("in memory", "out of core")
        assert ooc.verdict == mem.verdict and ooc.group_kinds() == mem.group_kinds(), other
        assert ooc.statistic == pytest.approx(mem.statistic, abs=1e-9)
        assert ooc.null == pytest.approx(mem.null, abs=1e-9) and len(ooc.null) == len(mem.null)
        assert [t["name"] for t in ooc.tensors] == [t["name"] for t in mem.tensors]
        for x, y in zip(ooc.tensors, mem.tensors):
            assert x["correlation"] == pytest.approx(y["correlation"], abs=1e-7), x["name"]
            assert x["rel_distance"] == pytest.approx(y["rel_distance"], abs=1e-7), x["name"]


def test_the_command_compares_out_of_core(dirs, capsys):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "copy", "--out-of-core", "--json")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["verdict"] == "same" and rec["mode"] == "out of core" and rec["max_rel_distance"] < 1e-6
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "gpt2", "--out-of-core")
    assert rc == 2 and "architecture" in " ".join(err.split())


@pytest.mark.slow  # 7 s; the float32 out-of-core path is in the default suite
def test_a_bfloat16_copy_out_of_core_is_the_same(tmp_path):
    """16-bit checkpoints are solved and moved in float32 out of core (as the engine merges
    them), in float64 in memory: the same verdict, numbers within bfloat16's rounding."""
    import torch
    from symgraph.cli.compare import compare_paths
    A = models.build("llama", seed=0, **L)
    A.to(torch.bfloat16).save_pretrained(tmp_path / "a")
    _moved(models.build("llama", seed=0, **L), 1).to(torch.bfloat16).save_pretrained(tmp_path / "b")
    mem, ooc = (compare_paths(str(tmp_path / "a"), str(tmp_path / "b"), null=0, out_of_core=o) for o in (False, True))
    assert mem.verdict == ooc.verdict == "same" and ooc.mode == "out of core" and ooc.tolerance == 1e-2
    assert ooc.max_rel_distance == pytest.approx(mem.max_rel_distance, abs=1e-6)

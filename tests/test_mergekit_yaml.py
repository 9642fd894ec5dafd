"""mergekit's YAML read by ``symgraph merge --config``: linear is symgraph's average (after
alignment), per-model weights; methods that need a base model and unknown keys refused."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

import symgraph
from symgraph.app.config import read_merge_config
from symgraph.testing import models

from conftest import cli

G = dict(vocab=64, hidden=32, layers=2, heads=4, positions=64)


def _yaml(tmp_path, text):
    p = tmp_path / "mk.yaml"
    p.write_text(text)
    return p


@pytest.mark.slow
def test_linear_with_weights_merges_like_symgraph(tmp_path):
    A, B = models.build("gpt2", seed=0, **G), models.build("gpt2", seed=1, **G)
    A.save_pretrained(tmp_path / "a")
    B.save_pretrained(tmp_path / "b")
    cfg = _yaml(tmp_path, "merge_method: linear\nmodels:\n  - model: a\n    parameters:\n      weight: 0.7\n"
                          "  - model: b\n    parameters:\n      weight: 0.3\nparameters:\n  normalize: true\ndtype: bfloat16\n")
    opts = read_merge_config(str(cfg))
    assert opts["method"] == "average" and opts["weights"] == [0.7, 0.3]
    assert opts["models"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    r = cli("merge", "--config", cfg, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "symgraph computes in float32" in " ".join(r.stderr.split())  # mergekit's dtype: said, not silent
    got = load_file(str(tmp_path / "o" / "model.safetensors"))
    want = symgraph.merge([A, B], weights=[0.7, 0.3]).model.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-5


@pytest.mark.parametrize("text,needle", [
    ("merge_method: ties\nbase_model: a\nmodels:\n  - model: a\n  - model: b\n", "shared base model"),
    ("merge_method: slerp\nmodels:\n  - model: a\n  - model: b\n", "no symgraph counterpart"),
    ("merge_method: linear\nslices:\n  - sources:\n    - model: a\n      layer_range: [0, 2]\n", "has 'slices'"),
    ("merge_method: linear\ndtype: int8\nmodels:\n  - model: a\n  - model: b\n", "compute dtype"),
    ("merge_method: linear\nmodels:\n  - model: a\n    parameters:\n      weight: 1\n      density: 0.5\n"
     "  - model: b\n", "density"),
    ("merge_method: linear\nmodels:\n  - model: a\n    parameters:\n      weight: 1\n  - model: b\n", "a weight for each"),
    ("merge_method: linear\nparameters:\n  normalize: false\nmodels:\n  - model: a\n  - model: b\n", "normalize"),
])
def test_mergekit_refusals_name_what_is_wrong(tmp_path, text, needle):
    with pytest.raises(symgraph.InputError) as e:
        read_merge_config(str(_yaml(tmp_path, text)))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mergekit_refusal_through_the_cli_is_one_paragraph(tmp_path):
    r = cli("merge", "--config", _yaml(tmp_path, "merge_method: ties\nbase_model: a\nmodels:\n  - model: a\n"
                                                  "  - model: b\n"), "--out", tmp_path / "o")
    assert r.returncode == 2 and "shared base model" in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


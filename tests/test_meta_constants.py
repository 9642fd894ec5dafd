"""Tensor constants a forward creates on the model's device (index lists, as Falcon's multi-query
split ``x[..., [-2], :]`` was before transformers 5.25: :mod:`index_constants`): a model built on
``meta`` from a checkpoint's headers holds no values for them, so the trace takes them from a twin
whose weights are fake CPU tensors; the meta model's report then equals the loaded model's, and
out-of-core comparison finds every class."""
from __future__ import annotations

import pytest
import torch
import transformers

import symgraph
from index_constants import falcon_config, index_split_falcon
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.cli.compare import compare_paths


@pytest.fixture(autouse=True)
def _index_lists(monkeypatch):
    index_split_falcon(monkeypatch)


def _falcon(seed=0):
    torch.manual_seed(seed)
    return transformers.FalconForCausalLM(falcon_config()).eval()


def _kinds(report):
    return sorted((g.kind, g.size, g.blocks) for g in report.groups)


def test_a_meta_models_index_constants_have_values_and_its_report_is_the_loaded_ones(tmp_path):
    model = _falcon()
    model.save_pretrained(tmp_path / "a")
    meta = Checkpoint(str(tmp_path / "a")).model
    assert next(meta.parameters()).is_meta
    loaded, built = symgraph.analyze(model), symgraph.analyze(meta)
    consts = {k: v for k, v in built.exported_program.constants.items() if "lifted" in k}
    assert consts and all(not v.is_meta for v in consts.values())
    assert sorted(int(v) for v in consts.values() if v.numel() == 1) == [-2, -2, -1, -1]
    assert _kinds(built) == _kinds(loaded) and len(built.groups) == 9


@pytest.mark.slow  # 15 s; the out-of-core Falcon merge in tests/test_merge_refusals.py runs by default
def test_a_transformed_falcon_copy_is_the_same_out_of_core(tmp_path):
    a = _falcon()
    rep = symgraph.analyze(a)
    b = symgraph.transform(a, rep.random_transform(seed=0))  # every group: GL per head, scaled RoPE pairs
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    got = compare_paths(str(tmp_path / "a"), str(tmp_path / "b"), null=0, out_of_core=True)
    assert got.mode == "out of core" and got.verdict == "same"
    assert got.max_rel_distance < 1e-6

"""``symgraph merge --full-groups`` out of core: each head's GL map, RoPE's pair scales and
ReLU units' scales are fitted from the stored tensors, read on demand within the engine's
budget, with the numbers of the in-memory merge; a transformed copy (full groups, not only
their orthogonal part) merges back into the model exactly."""
from __future__ import annotations


import pytest

import symgraph
from symgraph.cli.main import main as cli
from symgraph.errors import InputError
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.testing import models

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
BUDGET = "256KB"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two seeds of a tiny LLaMA (m0, m1) and a random full-group transform of m0 (t0)."""
    d = tmp_path_factory.mktemp("pair")
    for i in range(2):
        models.build("llama", seed=i, **SIZES).save_pretrained(str(d / f"m{i}"))
    A = models.build("llama", seed=0, **SIZES)
    symgraph.transform(A, symgraph.analyze(A).random_transform(seed=0)).save_pretrained(str(d / "t0"))
    return d


_load, _rel = load, rel


def _streamed(paths, out, full=True):
    cfg = MergeConfig(models=[str(p) for p in paths], out=str(out), full_groups=full, memory_budget=BUDGET)
    got = run_merge(cfg, streaming=True, progress=False)
    assert got.mode == "streaming"
    return got.job


@pytest.mark.slow  # 6 s; tests/test_engine.py runs full groups both ways on its pair by default
def test_full_groups_run_out_of_core_and_equal_the_in_memory_merge(pair, tmp_path, capsys):
    paths = [str(pair / "m0"), str(pair / "m1")]
    assert cli(["merge", *paths, "--full-groups", "--out", str(tmp_path / "s"), "--memory-budget", BUDGET]) == 0
    assert "loaded in memory" not in capsys.readouterr().err  # out of core, not a silent load
    mem = run_merge(MergeConfig(models=paths, out=str(tmp_path / "m"), full_groups=True), streaming=False,
                    progress=False)
    assert mem.mode == "in-memory"
    streamed = _load(tmp_path / "s")
    assert _rel(streamed, _load(tmp_path / "m")) < 1e-5
    plain = _streamed(paths, tmp_path / "p", full=False)
    assert _rel(streamed, _load(tmp_path / "p")) > 1e-3  # the fit changed the merge
    kinds = {g.id: g.kind for g in plain.report.groups}
    fitted = _streamed(paths, tmp_path / "f").alignments[1].full_groups
    assert set(fitted) == {g for g, k in kinds.items() if k in ("gl", "rope")}
    assert fitted == mem.job.alignments[1].full_groups  # the same fits kept, block by block


def test_a_transformed_copy_merges_back_out_of_core_within_the_budget(pair, tmp_path):
    from symgraph.checkpoints.sharded import parse_size
    job = _streamed([pair / "m0", pair / "t0"], tmp_path / "full")
    A, merged = _load(pair / "m0"), _load(tmp_path / "full")
    assert _rel(merged, A) < 1e-5
    assert 0 < job.resources.ledger.peak <= parse_size(BUDGET) and job.resources.ledger.now == 0
    _streamed([pair / "m0", pair / "t0"], tmp_path / "orth", full=False)
    assert _rel(_load(tmp_path / "orth"), A) > 1e-3  # the orthogonal solve alone is not exact


def test_relu_unit_scales_are_fitted_out_of_core(tmp_path):
    """A ReLU MLP's scaled permutation: each unit's scale fitted from the stored tensors."""
    A = models.build("gpt2", activation_function="relu")
    rep = symgraph.analyze(A)
    assert "scaled_perm" in {g.kind for g in rep.groups}
    A.save_pretrained(str(tmp_path / "a"))
    symgraph.transform(A, rep.random_transform(seed=0)).save_pretrained(str(tmp_path / "b"))
    job = _streamed([tmp_path / "a", tmp_path / "b"], tmp_path / "o")
    assert any(str(v).endswith("unit scales") for v in job.alignments[1].full_groups.values())
    assert _rel(_load(tmp_path / "o"), _load(tmp_path / "a")) < 1e-5
    assert job.resources.ledger.now == 0


def test_align_tensors_needs_the_stored_tensors_for_full_groups():
    from symgraph.alignment.driver import align_tensors
    A = models.build("llama", seed=0, **SIZES)
    rep = symgraph.analyze(A)
    tensors = {k: A.get_parameter(k).detach() for k in rep.parameters}
    with pytest.raises(InputError, match="full_groups from tensors needs sides"):
        align_tensors(rep, rep, tensors, tensors, {}, full_groups=True)


@pytest.mark.slow  # the merges equal in memory by default; this compares the fitted elements too
def test_the_fit_from_checkpoints_is_the_fit_from_loaded_models(pair):
    """Given one orthogonal solution of two seeds, fitting the full groups from the checkpoints
    (read on demand) and from the loaded models keeps the same fits and gives the same elements.
    (Not on a transformed copy: its co and contra fits are both exact, and which wins the tie
    depends on the last bits.)"""
    import copy

    import torch

    from symgraph.alignment.driver import AlignOptions
    from symgraph.alignment.fullgroups import ModelSides, fit_full_groups
    from symgraph.checkpoints.specs import load_model
    from symgraph.merging.streaming import StreamingMerge
    from symgraph.merging.engine.views import Folded, Ledger, Sides
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")])
    job.align()
    al, (A, B), ledger = job.alignments[1], job.checkpoints, Ledger()
    fits = []
    for sides in (ModelSides(load_model(str(pair / "m0")), load_model(str(pair / "m1"))),
                  Sides(A, B, (Folded(job.report, A, ledger=ledger), Folded(job.report, B, ledger=ledger)),
                        1 << 20, ledger)):
        mine = copy.copy(al)
        mine.elements = dict(al.elements)
        fits.append((fit_full_groups(mine, sides, AlignOptions()), mine.elements))
    assert fits[0][0] == fits[1][0]
    for g, E in fits[0][1].items():
        if isinstance(E, torch.Tensor):
            torch.testing.assert_close(fits[1][1][g], E, rtol=0, atol=1e-10)

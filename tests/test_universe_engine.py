"""The shared universe on the merge engine: ``symgraph merge a b c --anchor universe`` runs the
universe's rounds as engine plans out of core (each leave-one-out mean written by the engine
within the budget, each checkpoint aligned to it tensor by tensor) and equals the in-memory
``symgraph.merge([a, b, c], anchor="universe")``; ``--anchor N`` reaches the engine's anchor."""
from __future__ import annotations

import json
import os

import pytest
import torch

import symgraph
from symgraph.checkpoints.sharded import parse_size
from symgraph.cli.main import main
from symgraph.app.run import merge_checkpoints
from symgraph.merging.streaming import StreamingMerge
from symgraph.merging.universe import SCRATCH_PREFIX
from symgraph.testing import models

from engine_helpers import load, rel

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
BUDGET = "64KB"


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("universe_engine")
    built = [models.build("llama", seed=s, **L) for s in range(3)]
    for i, m in enumerate(built):
        m.save_pretrained(root / f"m{i}")
    return root, built


@pytest.mark.slow
def test_command_line_universe_out_of_core_equals_the_in_memory_universe(trio, capsys):
    root, built = trio
    out = root / "cli"
    rc = main(["merge", *(str(root / f"m{i}") for i in range(3)), "--anchor", "universe",
               "--memory-budget", BUDGET, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rec = json.loads((out / "symgraph_merge.json").read_text())
    assert rec["mode"] == "streaming" and rec["options"]["anchor"] == "universe"
    assert rec["universe"]["rounds"] >= 1 and len(rec["alignments"]) == 3  # every model has its map
    ref = symgraph.merge(built, anchor="universe")
    got, want = load(out), {k: v for k, v in ref.model.state_dict().items() if k in load(out)}
    assert got.keys() == want.keys()
    assert rel(got, want) <= 1e-5
    assert rec["universe"]["changed"] == ref.universe["changed"]  # the same rounds, element for element
    plain = symgraph.merge(built).model.state_dict()  # not the anchor merge
    assert max(float((got[k] - plain[k]).abs().max()) for k in got) > 1e-3
    assert not [p for p in os.listdir(root) if p.startswith(SCRATCH_PREFIX)]  # the rounds' means removed


@pytest.mark.slow
def test_the_universe_rounds_hold_no_more_than_the_budget(trio):
    root, _ = trio
    job = merge_checkpoints([str(root / f"m{i}") for i in range(3)], str(root / "py"), anchor="universe",
                            memory_budget=BUDGET)
    assert 0 < job.resources.ledger.peak <= parse_size(BUDGET) and job.resources.ledger.now == 0
    cli = root / "cli"
    if cli.exists():  # the same plan as the command's
        got, want = load(root / "py"), load(cli)
        assert all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("method,tol", [("regmean", 1e-5), ("fisher", 2e-5)])
@pytest.mark.slow
def test_every_method_merges_the_universe_out_of_core_within_the_budget(trio, method, tol):
    """RegMean's Grams and Fisher's squared gradients taken out of core with every model's map
    into the universe equal the in-memory universe merge (Fisher's tolerance: its out-of-core
    and in-memory merges already differ by about 5e-6 at an anchor on these models)."""
    root, built = trio
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i:i + 8]} for i in (0, 8)]
    job = merge_checkpoints([str(root / f"m{i}") for i in range(3)], str(root / method), anchor="universe",
                            method=method, data=data, memory_budget="128KB")  # a statistics pass: as test_engine's
    assert 0 < job.resources.ledger.peak <= parse_size("128KB") and job.resources.ledger.now == 0
    ref = symgraph.merge(built, anchor="universe", method=method, data=data).model.state_dict()
    got = load(root / method)
    assert rel(got, {k: ref[k] for k in got}) <= tol
    assert json.loads((root / method / "symgraph_merge.json").read_text())["options"]["method"] == method


@pytest.mark.slow
def test_activation_universe_out_of_core_equals_in_memory(trio):
    """Aligned by activations, each round's target is measured with its own weights in memory too
    (the report of models[0] would run models[0]'s: every round then aligned to model 0, which
    out of core, where the mean's weights are read, it is not): the same rounds and elements."""
    root, built = trio
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i:i + 8]} for i in (0, 8)]
    opts = {"max_rounds": 2}
    job = StreamingMerge([str(root / f"m{i}") for i in range(3)], align="activations", data=data,
                         memory_budget="128KB", anchor="universe", universe=opts, scratch=str(root))
    job.align()
    rec = job.universe
    ref = symgraph.merge(built, anchor="universe", align="activations", data=data, universe_options=opts)
    assert rec["changed"] == ref.universe["changed"] and rec["changed"][0] > 1
    for al, want in zip(job.alignments, ref.alignments):
        assert al.elements.keys() == want.elements.keys()
        for g, e in al.elements.items():
            x, y = (v.dense() if hasattr(v, "dense") else v for v in (e, want.elements[g]))
            assert float((x.double() - y.double()).abs().max()) < 1e-4, g
    os.makedirs(root / "acts")
    job.write(str(root / "acts"))
    got, sd = load(root / "acts"), ref.model.state_dict()
    assert rel(got, {k: sd[k] for k in got}) <= 1e-5
    assert 0 < job.resources.ledger.peak <= parse_size("128KB")


def test_anchor_index_reaches_the_engine(trio, capsys):
    root, built = trio
    rc = main(["merge", str(root / "m0"), str(root / "m1"), "--anchor", "1", "--out", str(root / "a1")])
    assert rc == 0, capsys.readouterr().err
    ref = symgraph.merge(built[:2], anchor=1).model.state_dict()
    got = load(root / "a1")
    assert rel(got, {k: ref[k] for k in got}) <= 1e-5
    anchor0 = symgraph.merge(built[:2]).model.state_dict()
    assert max(float((got[k] - anchor0[k]).abs().max()) for k in got) > 1e-3  # model 1's basis, not model 0's


@pytest.mark.parametrize("argv,said", [
    (["--anchor", "universe", "--align", "none"], "--anchor universe aligns every model to the mean of the others"),
    (["--anchor", "3"], "--anchor 3 is not one of the 2 models; expected an index 0..1 or universe"),
    (["--anchor", "first"], "--anchor 'first'; expected a model index (0, 1, ...) or 'universe'"),
])
def test_bad_anchor_refused_in_one_line(trio, capsys, argv, said):
    root, _ = trio
    rc = main(["merge", str(root / "m0"), str(root / "m1"), *argv, "--out", str(root / "never")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("symgraph:") == 1 and "Traceback" not in err, err
    assert said in " ".join(err.split())
    assert not (root / "never").exists()

"""One universe (issue 61, item 4): ``symgraph merge a b c --anchor universe --memory-budget B
--out DIR`` equals ``symgraph.merge([a, b, c], anchor="universe")`` for ``--align weights`` and
every method the universe merges with, the command's held bytes within the budget; and the
in-memory universe runs the same rounds of engine plans (no model's state averaged by hand)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import symgraph
from symgraph.checkpoints.sharded import parse_size
from symgraph.checkpoints.specs import load_data
from symgraph.cli.main import main
from symgraph.merging import streaming
from symgraph.merging.engine import views
from symgraph.testing import models

from engine_helpers import load

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("universe_cli")
    built = [models.build("llama", seed=s, **L) for s in range(3)]
    for i, m in enumerate(built):
        m.save_pretrained(root / f"m{i}")
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(root / "ids.safetensors"))
    return root, built


@pytest.fixture
def held(monkeypatch):
    """The most bytes any of the engine's ledgers held at once while the test ran."""
    most = [0]
    hold = views.Ledger.hold

    def counted(self, n):
        hold(self, n)
        most[0] = max(most[0], self.now)
    monkeypatch.setattr(views.Ledger, "hold", counted)
    return most


# RegMean and Fisher read each group's statistics with its tensors: their smallest budget on these
# models is about 116 kB (64KB is refused in one line naming it, as at an anchor)
@pytest.mark.parametrize("method,budget", [("average", "64KB"), ("regmean", "128KB"), ("fisher", "128KB")])
@pytest.mark.slow
def test_command_line_universe_equals_the_in_memory_universe(trio, capsys, held, method, budget):
    root, built = trio
    out = root / f"out_{method}"
    argv = ["merge", *(str(root / f"m{i}") for i in range(3)), "--anchor", "universe", "--align", "weights",
            "--memory-budget", budget, "--out", str(out)]
    data = None
    if method != "average":
        argv += ["--method", method, "--data", str(root / "ids.safetensors")]
        data = load_data(str(root / "ids.safetensors"), built[0])
    assert main(argv) == 0, capsys.readouterr().err
    assert f"merged 3 models ({method}, align=weights, shared universe, out of core)" in capsys.readouterr().out
    assert 0 < held[0] <= parse_size(budget)
    rec = json.loads((out / "symgraph_merge.json").read_text())
    assert (rec["options"]["anchor"], rec["options"]["align"], rec["options"]["method"]) == ("universe", "weights", method)
    ref = symgraph.merge(built, anchor="universe", align="weights", method=method, data=data)
    got, want = load(out), ref.model.state_dict()
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in got) <= 1e-5
    u = rec["universe"]
    assert u["rounds"] == ref.universe["rounds"] >= 1 and u["changed"] == ref.universe["changed"]
    assert u["distance"] == pytest.approx(ref.universe["distance"], rel=1e-5)  # the same record, distance too
    assert len(u["distance"]) == u["rounds"] + 1 and u["distance"][-1] < u["distance"][0]


@pytest.mark.parametrize("argv,said", [
    # a method that reads statistics with each group, below its smallest budget (as at an anchor)
    (["--method", "fisher", "--data", "ids.safetensors", "--memory-budget", "64KB"],
     "--memory-budget 64 kB is below what this merge holds at once"),
    # circuit-space heads average every model's circuits in one anchor's heads: no universe
    (["--attention", "circuits"], "--anchor universe aligns every model to the mean of the others; expected "
                                  "--align weights or activations, with --attention heads"),
])
def test_universe_refusals_in_one_line(trio, capsys, argv, said):
    root, _ = trio
    out = root / "never"
    argv = [str(root / a) if a.endswith(".safetensors") else a for a in argv]
    rc = main(["merge", *(str(root / f"m{i}") for i in range(3)), "--anchor", "universe", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("symgraph:") and "warning" not in ln]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert said in " ".join(err.split())
    assert not out.exists()


def test_in_memory_universe_means_are_engine_plans(trio, monkeypatch):
    """Every round writes N leave-one-out means through the engine (model 0's reads every model
    and measures the round's starting ``distance``; another model's leaves that model unread),
    then one plan measures the last distance and one merges: R·N + 2 plans for R rounds."""
    _, built = trio
    plans = []
    write_into = streaming.StreamingMerge.write_into

    def counted(self, add, device=None):
        plans.append(([c.path for c in self.checkpoints], [float(w) for w in self.weights]))
        return write_into(self, add, device)
    monkeypatch.setattr(streaming.StreamingMerge, "write_into", counted)
    res = symgraph.merge(built, anchor="universe", universe_options={"max_rounds": 2})
    assert res.universe["rounds"] == 2 and len(res.universe["distance"]) == 3 and len(plans) == 2 * 3 + 2
    every = ["model 0", "model 1", "model 2"]
    assert plans[-2:] == [(every, pytest.approx([1 / 3] * 3))] * 2  # the last distance, the merge
    for r in range(2):
        assert plans[3 * r:3 * r + 3] == [(every, pytest.approx([0, .5, .5])),
                                          (["model 0", "model 2"], pytest.approx([.5, .5])),
                                          (["model 0", "model 1"], pytest.approx([.5, .5]))]


@pytest.mark.slow  # ten rounds of learned matching, out of core and in memory: about a minute
def test_universe_with_learned_matching_runs_out_of_core_and_equals_the_in_memory_one(trio, capsys, held):
    """``--refine N`` with ``--anchor universe``: every round aligns each model to its mean by
    learned matching, out of core within the budget (no model loaded), and gives the in-memory
    universe's tensors and rounds, the same engine running both."""
    root, built = trio
    out = root / "out_refine"
    argv = ["merge", *(str(root / f"m{i}") for i in range(3)), "--anchor", "universe", "--refine", "2",
            "--data", str(root / "ids.safetensors"), "--memory-budget", "1MB", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    assert "loaded in memory" not in said.err
    assert "(average, align=activations, refine=2, shared universe, out of core)" in said.out
    assert 0 < held[0] <= parse_size("1MB")
    rec = json.loads((out / "symgraph_merge.json").read_text())
    ref = symgraph.merge(built, anchor="universe", refine=2, data=load_data(str(root / "ids.safetensors"), built[0]))
    got, want = load(out), ref.model.state_dict()
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in got) <= 1e-5
    assert [a["refined"]["steps"] for a in rec["alignments"]] == [2, 2, 2]  # every model, each round
    assert rec["universe"]["rounds"] == ref.universe["rounds"] and rec["universe"]["changed"] == ref.universe["changed"]


def test_a_universe_refuses_what_only_symgraph_align_takes(trio):
    """A loss of the user's, ``between`` or ``rescale`` reach only :func:`symgraph.align`; a
    universe's rounds run in the merge engine, so they are refused there in one line."""
    _, built = trio
    with pytest.raises(symgraph.InputError, match="anchor='universe' aligns in the merge engine's rounds, which "
                                                  "take no rescale; expected it with an anchor index"):
        symgraph.merge(built, anchor="universe", rescale=True)

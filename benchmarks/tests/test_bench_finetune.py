"""Fine-tune after fusion (benchmarks.bench_finetune) end to end on a toy setting.

The command line runs once per module: parents trained for a few steps into a temporary cache,
both default pairs (same width: gpt2 + gpt2; different widths: gpt2 + gpt2_wide), K = 4
fine-tuning steps evaluated every 2 steps on 2 held-out batches. The tests check the values it
returned and wrote against models rebuilt here.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import symgraph
from benchmarks import bench_finetune, evaluate, speed, train, zoo

pytestmark = pytest.mark.slow  # trains parents and fine-tunes merges in its fixture (setup ~10-55 s)

STEPS = 10          # parent training steps
K, EVERY = 4, 2     # fine-tuning budget and evaluation interval
EVAL_BATCHES = 2
ALIGN_BATCHES = 2
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    parent = tmp_path_factory.mktemp("results")
    (parent / "keep.txt").write_text("not ours")
    out = parent / "finetune"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMGRAPH_CACHE", str(cache))
        result = bench_finetune.main(["--out", str(out), "--steps", str(STEPS), "--K", str(K),
                                      "--eval-every", str(EVERY), "--eval-batches", str(EVAL_BATCHES),
                                      "--align-batches", str(ALIGN_BATCHES)])
        # the models and losses the records must match, rebuilt from the same cache
        loss_fn = {a: evaluate.loss_fn_for(a, max_batches=EVAL_BATCHES) for a in ("gpt2", "gpt2_wide")}
        parents = {(a, s): train.train_model(a, s, "quick", STEPS)
                   for a, s in (("gpt2", 0), ("gpt2", 1), ("gpt2_wide", 1))}
        cached = all(train.is_cached(a, s, "quick", STEPS) for a, s in parents)
        data = speed.alignment_data("gpt2", ALIGN_BATCHES)
        prev = torch.get_num_threads()
        torch.set_num_threads(train.num_threads())  # as during the run
        try:
            merged = {}
            for rec in result["pairs"]:
                p = rec["pair"]
                a, b = parents[(p["arch_a"], p["seed_a"])], parents[(p["arch_b"], p["seed_b"])]
                for name, align in (("fused_weights", "weights"), ("fused_activations", "activations"),
                                    ("vanilla", None)):
                    if name in rec["contestants"]:
                        m = symgraph.merge([a, b], align=align, data=data if align == "activations" else None)
                        merged[(p["slug"], name)] = loss_fn["gpt2"](m.model)
            parent_losses = {k: loss_fn[k[0]](m) for k, m in parents.items()}
            # the fine-tuning is deterministic: parent A again, same data seed
            proto = result["protocol"]
            again = bench_finetune._finetune(parents[("gpt2", 0)], "gpt2", K, EVERY, proto["lr"],
                                             proto["batch_size"], proto["data_seed"], loss_fn["gpt2"])
        finally:
            torch.set_num_threads(prev)
    return {"result": result, "out": out, "parent": parent, "merged": merged,
            "parent_losses": parent_losses, "again": again, "cached": cached}


def _pair(result, slug):
    (rec,) = [r for r in result["pairs"] if r["pair"]["slug"] == slug]
    return rec


def test_protocol_recorded(run):
    p = run["result"]["protocol"]
    assert (p["K"], p["eval_every"], p["eval_batches"], p["align_batches"], p["parent_steps"]) == (
        K, EVERY, EVAL_BATCHES, ALIGN_BATCHES, STEPS)
    assert p["lr"] == pytest.approx(bench_finetune.FINETUNE_LR_FRACTION * 3e-3)
    assert p["batch_size"] == 32
    assert [r["pair"]["slug"] for r in run["result"]["pairs"]] == ["gpt2-0_gpt2-1", "gpt2-0_gpt2_wide-1"]
    assert run["cached"]  # the parents went into the (temporary) cache


def test_every_curve_has_K_over_eval_every_plus_one_finite_points(run):
    expected_steps = list(range(0, K + 1, EVERY))
    names = {"gpt2-0_gpt2-1": {"parent_a", "parent_b", "fused_weights", "fused_activations", "vanilla"},
             "gpt2-0_gpt2_wide-1": {"parent_a", "parent_b", "fused_weights", "fused_activations"}}
    for rec in run["result"]["pairs"]:
        assert set(rec["contestants"]) == names[rec["pair"]["slug"]]
        for name, c in rec["contestants"].items():
            assert c["steps"] == expected_steps, name
            assert len(c["loss"]) == K // EVERY + 1
            assert all(math.isfinite(v) for v in c["loss"]), (name, c["loss"])
            assert c["initial_loss"] == c["loss"][0] and c["final_loss"] == c["loss"][-1]
            assert c["loss"][-1] != c["loss"][0]  # the model was trained
            assert math.isfinite(c["final_train_loss"])


def test_parent_step0_is_the_parents_held_out_loss(run):
    for rec in run["result"]["pairs"]:
        p = rec["pair"]
        for name, key in (("parent_a", (p["arch_a"], p["seed_a"])), ("parent_b", (p["arch_b"], p["seed_b"]))):
            c = rec["contestants"][name]
            assert c["arch"] == key[0] and c["seed"] == key[1]
            assert c["initial_loss"] == pytest.approx(run["parent_losses"][key], rel=1e-12, abs=0)
    # parent A is the same model in both pairs: fine-tuned once, reproducibly
    a1 = _pair(run["result"], "gpt2-0_gpt2-1")["contestants"]["parent_a"]
    a2 = _pair(run["result"], "gpt2-0_gpt2_wide-1")["contestants"]["parent_a"]
    assert a1["loss"] == a2["loss"]
    assert run["again"]["loss"] == pytest.approx(a1["loss"], rel=1e-6)


def test_fused_step0_is_the_loss_of_symgraph_merge(run):
    assert len(run["merged"]) == 5
    for (slug, name), loss in run["merged"].items():
        c = _pair(run["result"], slug)["contestants"][name]
        assert c["initial_loss"] == pytest.approx(loss, rel=1e-6, abs=0), (slug, name)
        assert c["arch"] == "gpt2"  # A's architecture, also for the narrow/wide pair
        assert c["num_parameters"] == sum(p.numel() for p in zoo.build_model("gpt2", 0).parameters())


def test_summary_consistent_with_curves(run):
    for rec in run["result"]["pairs"]:
        cs, s = rec["contestants"], rec["summary"]
        parents = {k: cs[k]["final_loss"] for k in ("parent_a", "parent_b")}
        fused = {k: cs[k]["final_loss"] for k in ("fused_weights", "fused_activations")}
        assert s["best_parent"] == min(parents, key=parents.get)
        assert s["best_parent_after_K"] == min(parents.values())
        assert s["best_parent_untuned"] == min(cs[k]["loss"][0] for k in parents)
        assert s["best_fused"] == min(fused, key=fused.get)
        assert s["fused_after_K"] == min(fused.values())
        assert s["fusion_beats_best_parent"] == (min(fused.values()) < min(parents.values()))
        assert s["margin"] == pytest.approx(min(parents.values()) - min(fused.values()))
        for k, f in s["fused"].items():
            assert f["beats_best_parent"] == (fused[k] < min(parents.values()))
            assert f["margin"] == pytest.approx(min(parents.values()) - fused[k])
            per_step = [min(pa, pb) for pa, pb in zip(cs["parent_a"]["loss"], cs["parent_b"]["loss"])]
            below = [st for st, v, ref in zip(cs[k]["steps"], cs[k]["loss"], per_step) if v < ref]
            assert f["first_step_below_best_parent_same_step"] == (below[0] if below else None)
            below = [st for st, v in zip(cs[k]["steps"], cs[k]["loss"]) if v < s["best_parent_untuned"]]
            assert f["first_step_below_best_parent_untuned"] == (below[0] if below else None)
        if rec["same_width"]:
            assert rec["vanilla_note"] is None
            assert s["vanilla_after_K"] == cs["vanilla"]["final_loss"]
            assert s["fusion_beats_vanilla"] == (min(fused.values()) < cs["vanilla"]["final_loss"])
        else:
            assert "not defined" in rec["vanilla_note"] and "vanilla" not in cs
            assert s["vanilla_after_K"] is None and s["fusion_beats_vanilla"] is None
    assert [r["same_width"] for r in run["result"]["pairs"]] == [True, False]


def test_files_written(run):
    out, result = run["out"], run["result"]
    written = json.loads((out / "results.json").read_text())
    assert written["pairs"][0]["contestants"]["fused_weights"]["loss"] == \
        result["pairs"][0]["contestants"]["fused_weights"]["loss"]
    figures = written["protocol"]["figures"]
    assert figures == [f"finetune_{r['pair']['slug']}.png" for r in result["pairs"]]
    for name in figures:
        assert (out / name).read_bytes()[:8] == PNG
    report = (out / "report.md").read_text()
    for rec in result["pairs"]:
        s = rec["summary"]
        verdict = ("yes, fusion + fine-tune beats" if s["fusion_beats_best_parent"]
                   else "no, fusion + fine-tune does not")
        assert f"**{rec['pair']['name']}**: {verdict}" in report
        assert f"{s['fused_after_K']:.4f}" in report and f"{s['best_parent_after_K']:.4f}" in report
    assert "vanilla average not defined" in report
    # the temporary sibling is gone and nothing else beside DIR was touched
    assert sorted(p.name for p in run["parent"].iterdir()) == ["finetune", "keep.txt"]
    assert (run["parent"] / "keep.txt").read_text() == "not ours"


def test_plot_and_markdown_from_result(run, tmp_path):
    paths = bench_finetune.plot(run["result"], tmp_path / "figs")
    assert len(paths) == len(run["result"]["pairs"])
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == PNG
    assert bench_finetune.markdown(run["result"]).count("\n## ") == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"K": 5, "eval_every": 2}, "positive divisor"),
    ({"K": 0}, "K must be"),
    ({"pairs": [("gpt2", 0, "llama", 1)]}, "must share"),
    ({"pairs": []}, "empty"),
])
def test_bad_arguments_refused_before_any_work(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAPH_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        bench_finetune.run(**kwargs)
    assert not (tmp_path / "models").exists()

"""The benchmark suite end to end on a tiny setting, and the method building blocks.

The runner is executed once per session (ViT only: no tokenizer to train; 2 seeds trained for
a few steps into a temporary cache), and the tests check the values it wrote.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

import symgraph
from benchmarks import suite as runner
from benchmarks import evaluate, methods, train, zoo

pytestmark = pytest.mark.slow  # trains the suite's parents in its fixture (setup 35 s to minutes)

STEPS = 20


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("out") / "suite"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMGRAPH_CACHE", str(cache))
        summary = runner.run(str(out), quick=True, archs=["vit"], seeds=[0, 1], steps=STEPS)
        cached = [train.is_cached("vit", s, "quick", STEPS) for s in (0, 1)]
    records = json.loads((out / "results.json").read_text())
    return {"out": out, "summary": summary, "records": records, "cached": cached,
            "report": (out / "report.md").read_text()}


def _rec(records, method, kind=None):
    rs = [r for r in records if r["method"] == method and (kind is None or r["kind"] == kind)]
    assert len(rs) == 1, (method, len(rs))
    return rs[0]


def test_outputs_written(suite):
    out = suite["out"]
    for name in ("results.json", "report.md", "barrier_vit.png", "attention_correlation.png",
                 "class_graph_vit.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".bench-")]  # temp dir gone
    assert all(suite["cached"])  # checkpoints cached for the next run


def test_one_record_per_method_with_fields(suite):
    recs = [r for r in suite["records"] if r["kind"] in ("interpolation", "merged")]
    assert sorted(r["method"] for r in recs) == sorted(methods.METHODS)
    for r in recs:
        for key in ("arch", "method", "pair", "barrier", "loss_mid", "metric_mid", "seconds",
                    "align_seconds", "analyze_seconds", "loss_a", "loss_b", "metric_a", "metric_b"):
            assert key in r, key
        assert r["arch"] == "vit" and r["pair"] == [0, 1]
        assert math.isfinite(r["barrier"]) and r["seconds"] >= 0
        assert 0.0 <= r["metric_mid"] <= 1.0  # accuracy
        if r["kind"] == "interpolation":
            lam = [x for x, _ in r["curve"]]
            assert len(lam) == 21 and lam[0] == 0.0 and lam[-1] == 1.0
        assert (r["kind"] == "merged") == (r["method"].startswith(("fisher", "regmean"))
                                           or r["method"].endswith("_repair"))


def test_vanilla_barrier_is_curve_max_minus_endpoint_mean(suite):
    r = _rec(suite["records"], "vanilla")
    losses = [l for _, l in r["curve"]]
    assert r["barrier"] == pytest.approx(max(losses) - 0.5 * (losses[0] + losses[-1]), abs=1e-9)
    assert losses[-1] == pytest.approx(r["loss_a"], abs=1e-9)  # λ=1 is A
    assert losses[0] == pytest.approx(r["loss_b"], abs=1e-9)
    assert r["barrier"] == pytest.approx(r["barrier_curve"], abs=1e-9)
    assert r["loss_mid"] == pytest.approx(losses[10], abs=1e-12)


def test_exact_alignments_keep_b_function(suite):
    """Group elements (perms, rotations, rescaled rotations) leave B's loss unchanged."""
    for m in ("verma2024", "zhang2025", "zhang2025_rescale", "symgraph_weights", "symgraph_activations",
              "symgraph_weights_perm", "symgraph_activations_perm", "symgraph_refine"):
        r = _rec(suite["records"], m)
        assert r["loss_b_aligned"] == pytest.approx(r["loss_b"], abs=2e-4), m
        assert r["barrier"] == pytest.approx(r["barrier_curve"], abs=2e-4), m


def test_merged_barrier_is_midpoint_gap(suite):
    for m in ("fisher", "fisher_aligned", "regmean", "regmean_aligned"):
        r = _rec(suite["records"], m)
        assert r["curve"] is None
        assert r["barrier"] == pytest.approx(r["loss_mid"] - 0.5 * (r["loss_a"] + r["loss_b"]), abs=1e-12)
    assert _rec(suite["records"], "fisher")["align_seconds"] == 0.0
    assert _rec(suite["records"], "fisher_aligned")["align_seconds"] > 0.0


def test_speed_rows(suite):
    sp = [r for r in suite["records"] if r["kind"] == "speed"]
    assert sorted(r["method"] for r in sp) == ["align_activations", "align_weights", "analyze"]
    d = sp[0]["detail"]  # one fresh-process measurement behind all three rows
    assert all(r["detail"] == d for r in sp)
    assert d["arch"] == "vit" and d["size"] == "quick" and d["seeds"] == [0, 1]
    assert d["groups"] == 9 and d["threads"] >= 1
    assert d["alignment_batches"] == runner.settings_for(True).align_batches
    n = sum(p.numel() for p in zoo.build_model("vit", 0, "quick").parameters())
    assert d["parameters"] == n
    assert d["model_weights_mb"] == pytest.approx(4 * n / 2 ** 20)  # float32
    assert isinstance(d["baseline_rss_mb"], float) and 50 < d["baseline_rss_mb"] < 8192
    for r in sp:
        m = r["method"]
        assert r["arch"] == "vit" and r["pair"] == [0, 1] and r["size"] == "quick"
        assert r["barrier"] is None and r["metric_mid"] is None
        # the row's numbers are the measurement's, under the row's own method
        assert r["seconds"] == d[f"{m}_seconds"] and r["peak_rss_mb"] == d[f"peak_rss_{m}_mb"]
        assert isinstance(r["seconds"], float) and 0 < r["seconds"] < 300
        peak = r["peak_rss_mb"]
        assert isinstance(peak, float) and math.isfinite(peak), (m, peak)
        assert 0 < peak < 4096, (m, peak)  # above the baseline, and tiny models stay small


def test_report_tables(suite):
    md = suite["report"]
    section = md.split("## Loss barrier")[1].split("\n## ")[0]
    for m in methods.METHODS:
        row = re.search(rf"^\| {re.escape(m)} \| (\S+)", section, re.M)
        assert row, m
        val = float(row.group(1).strip("*"))
        assert val == pytest.approx(_rec(suite["records"], m)["barrier"], abs=1e-3)
    assert "## Findings" in md and "## Speed and memory" in md
    row = re.search(r"^\| vit \| (\S+) \| (\S+) `(\w+)` \((\S+)\)", md.split("## Targets")[1], re.M)
    van, best = _rec(suite["records"], "vanilla")["barrier"], float(row.group(2))
    assert float(row.group(1)) == pytest.approx(van, abs=1e-3)
    assert row.group(3) in methods.SYMGRAPH_METHODS and row.group(3) != "symgraph_refine"
    assert best == pytest.approx(_rec(suite["records"], row.group(3))["barrier"], abs=1e-3)
    assert float(row.group(4)) == pytest.approx(best / van, abs=0.01)
    assert "| vit |" in md.split("## Speed and memory")[1]
    assert "analyze_8b.json" in md  # the other issues' measurements are pulled in
    for fig in ("barrier_vit.png", "attention_correlation.png", "class_graph_vit.png"):
        assert f"({fig})" in md


def test_heatmap_alignment_raises_diagonal_correlation(suite):
    hm = suite["summary"]["heatmap"]
    assert hm["head_dim"] == zoo.get_setting("vit").hidden // zoo.get_setting("vit").heads
    assert hm["diag_after"] > hm["diag_before"] + 0.2


# --- building blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_roles_are_structural(arch):
    m = zoo.build_model(arch, 0)
    rep = symgraph.analyze(m, evaluate.example_inputs(arch))
    r = methods.roles(rep)
    layers = zoo.get_setting(arch).layers
    (res,) = r.residual
    assert rep.groups[res].size == zoo.get_setting(arch).hidden
    assert len(r.mlp) == len(r.heads) == len(r.vo_inner) == len(r.qk_inner) == layers
    assert all(rep.groups[g].size == zoo.get_setting(arch).mlp_width for g in r.mlp)
    # the output projections found by variance are the attention output layers
    suffix = {"gpt2": "attn.c_proj.weight", "llama": "self_attn.o_proj.weight",
              "bert": "attention.output.dense.weight"}[arch]
    assert len(r.out_params) == layers and all(n.endswith(suffix) for n in r.out_params)
    kinds = {rep.groups[g].kind for g in r.qk_inner}
    assert kinds == ({"rope"} if arch == "llama" else {"gl"})


def _pair(arch, steps=0):
    a, b = zoo.build_model(arch, 0), zoo.build_model(arch, 1)
    data = [(x["input_ids"],) for x in evaluate.eval_batches(arch, "train", 2)]
    return methods.Pair(arch, a, b, data, symgraph.analyze(a, data[0]), symgraph.analyze(b, data[0]))


def test_verma2024_ties_qk_to_vo_and_zhang2025_skips_residual():
    p = _pair("gpt2")
    r = methods.roles(p.report_a)
    out = methods.verma2024(p)
    els = out.alignment.elements
    gb = p.report_b.groups
    for qk in r.qk_inner:
        vo = next(v for v in r.vo_inner if gb[v].outer == gb[qk].outer)
        E = els[qk]
        assert torch.equal(E, els[vo])
        assert bool(((E == 0) | (E == 1)).all())  # permutations inside heads (Hungarian)
    out3 = methods.zhang2025(p)
    assert set(out3.alignment.results) == set(r.mlp | r.continuous_inner)


def test_rescale_heads_preserves_function_and_lowers_distance():
    p = _pair("gpt2")
    base = methods.zhang2025(p)
    out = methods.zhang2025_rescale(p)
    x = evaluate.eval_batches("gpt2", "eval", 1)[0]
    with torch.no_grad():
        ref = evaluate.model_logits(p.b, "gpt2", x)
        got = evaluate.model_logits(out.b_aligned, "gpt2", x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    scales = [s for v in out.extra["scales"].values() for s in v]
    assert len(scales) == 2 * zoo.get_setting("gpt2").layers * zoo.get_setting("gpt2").heads  # QK and VO
    assert all(s > 0 for s in scales) and any(abs(s - 1) > 1e-3 for s in scales)

    def dist(m):
        return sum(float((pa - pm).pow(2).sum()) for pa, pm in zip(p.a.parameters(), m.parameters()))
    assert dist(out.b_aligned) <= dist(base.b_aligned) + 1e-9


def test_targets_are_read_from_pair_means():
    from benchmarks import targets

    def rec(arch, method, *barriers):
        kind = "merged" if method.endswith("aligned") else "interpolation"
        return [{"arch": arch, "method": method, "kind": kind, "barrier": b} for b in barriers]

    records = (rec("a", "vanilla", 1.0, 2.0) + rec("a", "symgraph_weights", 0.3, 0.6)
               + rec("a", "symgraph_activations", 0.4, 0.6) + rec("a", "symgraph_refine", 0.05, 0.07)
               + rec("a", "verma2024", 0.5, 0.5) + rec("a", "imfeld2024", 0.1, 0.9)
               + rec("a", "regmean_aligned", 0.2, 0.2) + rec("a", "fisher_aligned", 0.1, 0.3)
               + rec("b", "vanilla", 1.0) + rec("b", "symgraph_weights", 0.2)
               + rec("b", "regmean_aligned", 0.1) + rec("c", "symgraph_weights", 0.1))
    a, b = targets.targets(records, ["a", "b", "c"])  # no vanilla for c: no row
    assert a["vanilla"] == pytest.approx(1.5)
    assert a["without"] == ("symgraph_weights", pytest.approx(0.45))
    assert a["ratio_without"] == pytest.approx(0.3) and a["ratio_refine"] == pytest.approx(0.04)
    assert a["seed"] == ("imfeld2024", pytest.approx(0.5))  # verma2024's mean is 0.5 too: ties by name
    assert a["aligned"][1] == pytest.approx(0.2)
    assert a["met"] == {"without refine": True, "with refine": True, "< seeds": True,
                        "< aligned Fisher, RegMean": True}
    assert b["refine"] is None and b["met"] == {"without refine": True, "with refine": None,
                                                "< seeds": None, "< aligned Fisher, RegMean": False}
    md = "\n".join(targets.section(records, ["a", "b"]))
    assert "| a | 1.500 | 0.450 `symgraph_weights` (0.30) | 0.060 (0.04) |" in md
    assert md.count("\n| ") == 3  # header and two rows


def test_former_seed_method_names_are_read_as_the_papers(tmp_path):
    """Records written before the seed methods were named after their papers (seed002...) load
    under the new names, and the report's tables say the new names with the renaming noted."""
    from benchmarks import records, report, targets
    old = [{"arch": "a", "method": m, "kind": "interpolation", "barrier": b}
           for m, b in (("vanilla", 1.0), ("seed002", 0.5), ("seed003", 0.4), ("seed003_rescale", 0.45),
                        ("seed004", 0.6), ("symgraph_weights", 0.3))]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(old))
    loaded = records.load_records(path)
    assert [r["method"] for r in loaded] == ["vanilla", "verma2024", "zhang2025", "zhang2025_rescale",
                                             "imfeld2024", "symgraph_weights"]
    assert old[1]["method"] == "seed002"  # renamed copies, the input untouched
    assert set(records.FORMER_NAMES.values()) == set(methods.SEED_METHODS) <= set(methods.METHODS)
    assert targets.targets(old, ["a"])[0]["seed"] == ("zhang2025", pytest.approx(0.4))
    table = report._metric_table(loaded, ["a"], list(methods.SEED_METHODS), "barrier")
    assert "zhang2025" in table and "seed00" not in table
    assert "formerly `seed002`" in records.RENAME_NOTE

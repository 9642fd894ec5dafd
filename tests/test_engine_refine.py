"""Learned matching out of core (:mod:`symgraph.merging.learned`): ``symgraph merge --refine N``
runs in the merge engine and equals the in-memory merge (the same start, losses, refined
elements and merged tensors) on an untied pair, whose norm gains (random) fold into the
residual stream's rotation, and a tied one (the embedding and the head, one tensor, read by the
first and the last segment); the bytes it holds stay within ``--memory-budget``, and a budget
its elements' optimiser state cannot fit in is refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from symgraph.cli.main import main as cli
from symgraph.core.elements import Perm
from symgraph.errors import InputError
from symgraph.alignment import learning
from symgraph.merging import learned
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.testing import models

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
STEPS = 6  # the data's 6 batches: 5 of 8 rows and one of 4 (a second traced shape)
BUDGET = 1 << 20


def _pair(d, tie, rows: int = 44):
    for i in range(2):  # norm gains drawn at random (not ones): folding them changes the tensors
        m = models.build("llama", seed=i, tie_word_embeddings=tie, **SIZES)
        models.randomize_vectors(m, seed=10 + i).save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (rows, 12), generator=g)}, str(d / "data.safetensors"))
    return d


@pytest.fixture(scope="module", params=["untied", "tied"])
def pair(request, tmp_path_factory):
    return _pair(tmp_path_factory.mktemp(request.param), request.param == "tied")


def _dense(e):
    return e.dense().double() if isinstance(e, Perm) else e.double()


class _Watch:
    """What the refine of the out-of-core job saw: the ledger's peak and bytes held when each of
    the shared steps' phases (:mod:`symgraph.alignment.learning`) began with the out-of-core
    objective, the segments each step ran, and the elements before refining."""

    def __init__(self, monkeypatch):
        self.peaks, self.segments, self.start = {}, [], None
        for name in ("choose_start", "refine_elements"):
            real = getattr(learning, name)

            def wrapped(first, objective, *args, _real=real, _name=name, **kw):
                if not isinstance(objective, learned._Matching):  # the in-memory merge's
                    return _real(first, objective, *args, **kw)
                ledger = objective.how.ledger
                if _name == "refine_elements":
                    self.start = dict(first.elements)
                before, ledger.peak = ledger.peak, ledger.now
                self.peaks[_name] = (ledger.now, None)
                try:
                    return _real(first, objective, *args, **kw)
                finally:
                    self.peaks[_name] = (self.peaks[_name][0], ledger.peak)
                    ledger.peak = max(before, ledger.peak)
            monkeypatch.setattr(learning, name, wrapped)
        real_segments = learned._Graph.segments

        def segments(g, cost, budget):
            out = real_segments(g, cost, budget)
            self.segments.append(len(out))
            return out
        monkeypatch.setattr(learned._Graph, "segments", segments)


def _compare(d, tmp_path, monkeypatch, capsys, cli_run: bool, flags=None):
    """The out-of-core merge (``symgraph merge`` or run_merge choosing) and the in-memory one of
    pair ``d`` (``flags``: more MergeConfig fields, ``fold_norms`` only); returns what the
    out-of-core refine saw."""
    watch = _Watch(monkeypatch)
    flags = flags or {}
    cfg = MergeConfig(models=[str(d / "m0"), str(d / "m1")], out=str(tmp_path / "stream"), refine=STEPS,
                      data=str(d / "data.safetensors"), memory_budget="1MiB", **flags)
    if cli_run:
        extra = ["--no-fold-norms"] if flags.get("fold_norms") is False else []
        assert cli(["merge", str(d / "m0"), str(d / "m1"), "--out", str(tmp_path / "stream"), "--refine",
                    str(STEPS), "--data", str(d / "data.safetensors"), "--memory-budget", "1MiB", *extra]) == 0
        job = None
    else:
        got = run_merge(cfg, progress=False)
        assert got.mode == "streaming"
        job = got.job
    assert "loaded in memory" not in capsys.readouterr().err  # out of core, not a silent load
    seen = list(watch.segments), dict(watch.peaks), getattr(watch, "start", None)  # the out-of-core run's
    mem = run_merge(cfg.model_copy(update={"out": str(tmp_path / "mem")}), streaming=False, progress=False)
    (watch.segments, watch.peaks, watch.start), in_memory = seen, watch.segments[len(seen[0]):]
    assert in_memory and set(in_memory) == {1}  # the same learned matching in memory: one segment, no budget
    assert mem.mode == "in-memory"
    streamed, loaded = load(tmp_path / "stream"), load(tmp_path / "mem")
    watch.diff, watch.job = rel(streamed, loaded), job
    assert watch.diff < 1e-5
    records = [json.loads((tmp_path / p / "symgraph_merge.json").read_text())["alignments"][0]["refined"]
               for p in ("stream", "mem")]
    a, b = records
    assert a["steps"] == b["steps"] == STEPS and a["classes"] == b["classes"] >= 5
    assert a["start"] == b["start"] and a["start_loss"].keys() == {"activations", "weights"}
    for k in ("loss_first", "loss_last"):
        assert a[k] == pytest.approx(b[k], rel=1e-6, abs=0)
    for k, v in b["start_loss"].items():
        assert a["start_loss"][k] == pytest.approx(v, rel=1e-6, abs=0)
    if job is not None:  # the refined elements themselves, and that refining moved them
        ours, theirs = job.alignments[1].elements, mem.job.alignments[1].elements
        assert ours.keys() == theirs.keys()
        moved = 0.0
        for gid, e in theirs.items():
            if isinstance(e, Perm):
                assert isinstance(ours[gid], Perm) and torch.equal(ours[gid].index, e.index), gid
            elif isinstance(e, torch.Tensor):
                assert float((_dense(ours[gid]) - _dense(e)).abs().max()) < 1e-5, gid
                moved = max(moved, float((_dense(ours[gid]) - _dense(watch.start[gid])).abs().max()))
        assert moved > 1e-3  # the steps changed the rotations (Adam's steps of 1e-3)
    return watch


@pytest.mark.slow
def test_refine_out_of_core_equals_in_memory_and_holds_its_budget(pair, tmp_path, monkeypatch, capsys):
    """The engine takes --refine (untied pair: run_merge choosing; tied pair: ``symgraph
    merge``); its start and losses, refined elements and merged tensors equal the in-memory
    merge's (float32 models: the merged tensors to 1e-5 of each tensor's largest entry, the
    continuous elements to 1e-5: float32 gradients' rounding, which Adam's normalised steps
    carry into the elements, is about 3e-7 after 6 steps; permutations identical); choosing the
    start and refining hold at most the memory budget (the elements' Adam state and the
    segments' tensors included), the model cut in several segments (more while refining: the
    elements' state takes part of the budget); everything held is let go."""
    tied = pair.name.startswith("tied")
    watch = _compare(pair, tmp_path, monkeypatch, capsys, cli_run=tied)
    if not tied:  # norm gains folded into the residual stream's rotation, moved back into A's
        assert len(watch.job.report.folds) >= 2 * SIZES["layers"]
    for phase in ("choose_start", "refine_elements"):
        held, peak = watch.peaks[phase]
        assert held == 0 and 0 < peak <= BUDGET, (phase, peak)
    assert min(watch.segments) >= 2 and max(watch.segments) >= 4  # the model does not fit one segment


def test_symgraph_merge_refine_without_folding(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """``symgraph merge --refine --no-fold-norms`` on an untied pair runs out of core and equals
    the in-memory merge (the residual stream then permuted, its gains moved, not folded)."""
    # batches of 8 rows only: unfolded, a batch of 4 traces to other groups, which activation matching refuses
    d = _pair(tmp_path_factory.mktemp("nofold"), False, rows=40)
    _compare(d, tmp_path, monkeypatch, capsys, cli_run=True, flags={"fold_norms": False})


def test_a_budget_the_elements_state_cannot_fit_is_refused(tmp_path_factory, tmp_path):
    """Learned matching holds its elements' parameters and Adam's moments besides one segment:
    a budget below them is refused, saying how much it needs (before any output is written)."""
    d = _pair(tmp_path_factory.mktemp("small"), True)
    cfg = MergeConfig(models=[str(d / "m0"), str(d / "m1")], out=str(tmp_path / "o"), refine=2,
                      data=str(d / "data.safetensors"), memory_budget="256KiB")
    with pytest.raises(InputError, match=r"learned matching holds [\d.]+ [kMG]?B of learnable elements.*"
                                         r"expected --memory-budget of at least [\d.]+ [kMG]?B \(the smallest"):
        run_merge(cfg, streaming=True, progress=False)
    assert not (tmp_path / "o").exists()


def test_the_engine_refuses_what_learned_matching_cannot_do_out_of_core(tmp_path_factory):
    """refine starts from activation matching on data, and lowers the model's own loss: the
    engine refuses it without them, and a loss or a model between of the caller's (those run
    loaded models: symgraph.align takes them)."""
    from symgraph.merging.streaming import StreamingMerge
    d = _pair(tmp_path_factory.mktemp("refusals"), True, rows=8)
    paths = [str(d / "m0"), str(d / "m1")]
    data = [{"input_ids": torch.zeros(2, 4, dtype=torch.long)}]
    for kw, why in (({"align": "weights", "data": data}, "refine starts from activation matching.*align says "
                     "weights; expected align activations"),
                    ({"align": "weights"}, "refine needs data"), ({"align": "activations"}, "refine needs data")):
        with pytest.raises(InputError, match=why):
            StreamingMerge(paths, refine=2, **kw)
    with pytest.raises(InputError, match="model's own loss.*expected no loss_fn or between"):
        StreamingMerge(paths, refine=2, align="activations", data=data, loss_fn=lambda m, b: 0)
    assert StreamingMerge(paths, refine=2, align="activations", data=data).config.refine == 2

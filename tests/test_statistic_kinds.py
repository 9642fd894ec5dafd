"""A merge method declares the statistic it needs from the engine's vocabulary
(:mod:`symgraph.merging.engine.statistics`) and never sees the engine (issue 61): a third
party's method declaring ``InputGrams()`` gets RegMean's Grams and RegMean's merge, in memory
and out of core; a new kind is one class and one taker; each kind moves into the anchor's
basis as a measurement of the aligned model says; no method takes the engine."""
from __future__ import annotations

import ast
import inspect
import pathlib
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import statistics_reference as reference
import symgraph
from engine_helpers import load, rel
from symgraph.errors import InputError
from symgraph.merging import InputGrams, MergeMethod, SquaredGradients
from symgraph.merging.engine.statistics import TAKERS, StatisticsContext, Taker, floor, take
from symgraph.merging.methods import registry
from symgraph.merging.methods.average import Average
from symgraph.merging.methods.fisher import Fisher, predictive_nll
from symgraph.merging.methods.regmean import RIDGE
from symgraph.merging.engine.sums import MemorySpill, Stored
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
METHODS = pathlib.Path(registry.__file__).parent


class PlainGrams(Average):
    """A third party's RegMean without regularisation: ``(Σ wᵢ Wᵢ Gᵢ + εW̄)(Σ wᵢ Gᵢ + εI)⁻¹`` per linear
    weight, from the Grams it declares; it keeps every Gram it is given (``seen``). Its plan
    (slices, bytes held) is RegMean's."""
    name, statistic = "plain_grams", InputGrams()

    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def combine_group(self, names, values, stats, weights, report):
        out = super().combine_group(names, values, stats, weights, report)
        for w, _, _, layout in report.linear_layers():
            if w not in names or not all(w in s for s in stats):
                continue
            grams = [s[w] for s in stats]
            self.seen[w] = [g.clone() for g in grams]
            Ws = [(v[w] if layout == "out_in" else v[w].T).to(torch.float64) for v in values]
            num = sum(x * W @ G for x, W, G in zip(weights, Ws, grams))
            den = sum(x * G for x, G in zip(weights, grams))
            den.diagonal().add_(RIDGE)  # RegMean's ridge, towards the average (an input no data reaches)
            num = num + RIDGE * (out[w] if layout == "out_in" else out[w].T).to(torch.float64)
            M = torch.linalg.solve(den.T, num.T).T
            out[w] = M if layout == "out_in" else M.T
        return out

    def sliceable(self, name, dim, report):
        return registry.get("regmean").sliceable(name, dim, report)

    def held_bytes(self, name, shape, item, n, report):
        return registry.get("regmean").held_bytes(name, shape, item, n, report)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    d = tmp_path_factory.mktemp("kinds")
    A, B = models.build("llama", seed=0, **SIZES), models.build("llama", seed=1, **SIZES)
    for name, m in (("a", A), ("b", B)):
        m.save_pretrained(str(d / name))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (2, 10), generator=g)} for _ in range(3)]
    return d, A, B, data


def test_a_method_declaring_input_grams_gets_regmeans_grams_and_merge(llamas):
    """In memory: the Grams the engine gives the method are the brute-force Grams of each model
    measured in the anchor's basis, and its merge is RegMean's with ``alpha=1``, which differs
    from the plain average."""
    _, A, B, data = llamas
    mine = PlainGrams()
    assert mine.needs_data and not mine.elementwise_statistics
    got = symgraph.merge([A, B], data=data, method=mine)
    want = symgraph.merge([A, B], data=data, method="regmean", method_options={"alpha": 1.0})
    avg = symgraph.merge([A, B], method="average")
    sd, ref = got.model.state_dict(), want.model.state_dict()
    assert rel(sd, ref) < 1e-6
    w = "model.layers.1.mlp.down_proj.weight"
    assert not torch.allclose(sd[w], avg.model.state_dict()[w], atol=1e-4)
    al = got.alignments[1]
    grams = [reference.input_grams(A, al.report_a, data),
             reference.in_anchor_basis(InputGrams(), B, al.report_b, al, al.report_a, data)]
    assert len(mine.seen) >= 7  # q, k, v, o, gate, up, down of a layer at least
    for w, seen in mine.seen.items():
        for i in (0, 1):
            err = float((seen[i] - grams[i][w]).abs().max() / grams[i][w].abs().max())
            assert err < 1e-5, (w, i, err)


def test_a_method_declaring_input_grams_runs_out_of_core_as_regmean(llamas, tmp_path):
    """Out of core, within a budget: the same method writes RegMean's (``alpha=1``) merge."""
    d, _, _, data = llamas
    out = {}
    for name, method, kw in (("mine", PlainGrams(), {}), ("regmean", "regmean", {"alpha": 1.0})):
        job = StreamingMerge([str(d / "a"), str(d / "b")], method=method, method_options=kw, data=data,
                             memory_budget="256KB")
        (tmp_path / name).mkdir()
        job.write(str(tmp_path / name))
        assert 0 < job.resources.ledger.peak <= 256 << 10 and job.resources.ledger.now == 0
        out[name] = load(tmp_path / name)
    assert rel(out["mine"], out["regmean"]) < 1e-6


@dataclass(frozen=True)
class ModelNumber:
    """A kind for the test: every parameter's statistic is its model's number (from 1)."""
    elementwise: ClassVar[bool] = True


def _take_number(kind, context: StatisticsContext, i: int) -> Stored:
    A = context.ckpts[context.anchor]
    shapes = {n: p.shape for n, p in A.model.named_parameters()}
    context.spill.put({f"number/{i}/{n}": torch.full(s, float(i + 1)) for n, s in shapes.items()})
    return Stored(context.spill, {n: f"number/{i}/{n}" for n in shapes})


class Numbered(MergeMethod):
    statistic = ModelNumber()

    def combine_group(self, names, values, stats, weights, report):
        return {k: sum(w * v[k] * s[k] for w, v, s in zip(weights, values, stats)) for k in names}


def test_a_new_kind_is_one_class_and_one_taker(monkeypatch):
    """A kind registered with its taker is taken by the engine for a method that declares it;
    unregistered, the method is refused in one line naming the kinds the engine takes."""
    A, B = models.mlp(0, (6, 16, 12, 3)), models.mlp(1, (6, 16, 12, 3))
    data = [(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)),)]
    with pytest.raises(InputError) as e:
        symgraph.merge([A, B], data=data, method=Numbered(), align=None)
    msg = str(e.value)
    assert "\n" not in msg and "ModelNumber()" in msg and "InputGrams, SquaredGradients" in msg
    monkeypatch.setitem(TAKERS, ModelNumber, Taker(_take_number))
    res = symgraph.merge([A, B], data=data, method=Numbered(), align=None)
    for k, p in res.model.named_parameters():
        want = 0.5 * 1 * A.get_parameter(k) + 0.5 * 2 * B.get_parameter(k)
        assert torch.allclose(p, want, atol=1e-6), k


def test_each_kind_moves_into_the_anchors_basis_as_the_aligned_model_measures():
    """Without norm folds a model's statistic in its own basis, moved by the kind's
    ``to_anchor`` (Grams ``M G Mᵀ``, squared gradients the squared map), is the statistic of the
    aligned model measured through the anchor's report (float32 models: to 1e-5 of each
    tensor's largest entry)."""
    A, B = models.mlp(0, (6, 16, 12, 3)), models.mlp(1, (6, 16, 12, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 6, generator=g),) for _ in range(2)]
    al = symgraph.align(A, B, data[0])
    ra, rb = al.report_a, al.report_b
    assert not ra.folds and al.elements
    for kind in (InputGrams(), SquaredGradients(loss=predictive_nll)):
        own = reference.of_kind(kind, B, rb, data)
        moved, measured = kind.to_anchor(own, al), reference.of_kind(kind, al.apply(B), ra, data)
        assert moved.keys() == measured.keys() and len(moved) >= 2
        changed = 0
        for k, v in measured.items():
            err = float((moved[k] - v).abs().max() / v.abs().max())  # float32 models' rounding
            assert err < 1e-5, (kind, k, err)
            changed += float((own[k] - v).abs().max() / v.abs().max()) > 1e-2
        assert changed >= 2, kind  # the map moved them: the test compares something


def test_take_and_floor_are_none_and_zero_without_a_statistic(llamas):
    """No statistic: nothing taken, no floor; Fisher's floor is its largest op's, named."""
    d, _, _, data = llamas
    job = StreamingMerge([str(d / "a"), str(d / "b")], method="fisher", data=data, align="none")
    job.align()
    context = StatisticsContext.of(job)
    assert take(None, context, 0) is None and floor(None, context) == (0, None)
    need, what = floor(Fisher.statistic, context)
    assert need > 0 and "largest op" in what
    job.spill = MemorySpill()
    st = take(Fisher.statistic, StatisticsContext.of(job), 0)
    assert set(st) >= {n for n, _ in job.checkpoints[0].model.named_parameters()}


def test_needs_data_follows_the_declared_statistic():
    kinds = {n: registry.get(n).statistic for n in ("average", "regmean", "fisher")}
    assert kinds["average"] is None and kinds["regmean"] == InputGrams()
    assert isinstance(kinds["fisher"], SquaredGradients) and kinds["fisher"].loss is predictive_nll
    assert [registry.get(n).needs_data for n in kinds] == [False, True, True]
    assert registry.get("fisher").elementwise_statistics and not registry.get("regmean").elementwise_statistics


def test_no_method_can_reach_the_engine():
    """No method (registered or the base) has a parameter naming the engine or a context, nor
    the old hooks that received it; no file of ``methods/`` imports the engine beyond the
    vocabulary of kinds, or names ``job``."""
    gone = {"streamed_statistics", "statistics_floor", "statistics", "to_anchor"}
    for name in registry.names():
        cls = type(registry.get(name))
        for base in (cls, MergeMethod):
            assert not gone & set(dir(base)), (name, gone & set(dir(base)))
            for attr, fn in inspect.getmembers(base, inspect.isfunction):
                params = set(inspect.signature(fn).parameters)
                assert not params & {"job", "context", "engine", "executor"}, (name, attr, params)
    for path in METHODS.glob("*.py"):
        tree = ast.parse(path.read_text())
        words = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
                {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        assert "job" not in words, path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and "engine" in node.module:
                assert node.module == "engine.statistics" and node.level == 2, (path.name, node.module)
                assert {a.name for a in node.names} <= {"InputGrams", "SquaredGradients", "check_kind"}, path.name
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("streaming", "backprop", "statistics"), (path.name, node.module)

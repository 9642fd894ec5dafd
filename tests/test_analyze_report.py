"""``symgraph.analyze``'s report and behaviour: meta-device models, strict mode and frozen
ops, JSON, graph files, the summary, inputs checked, the model left unchanged, certificates
without float64 kernels."""
from __future__ import annotations

import json

import pytest
import torch

import symgraph

from analyze_helpers import MLP, TOL, one
from conftest import build_hf, build_mlp


# --- 4. other behaviours ------------------------------------------------------------------
def _structure(report):
    return [(g.kind, g.size, g.dim, g.blocks, tuple(g.outer), g.pairs, sorted(g.params))
            for g in report.groups]


def test_meta_device_same_structure(llama):
    meta, _ = build_hf("llama", device="meta")
    assert all(p.is_meta for p in meta.parameters())
    report = symgraph.analyze(meta)
    assert _structure(report) == _structure(llama.report)
    with pytest.raises(symgraph.InputError, match="meta"):
        report.certify(meta)


class _Sorter(torch.nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1).values


class _Unruled(torch.nn.Module):
    """An MLP with an op symgraph has no rule for (sort over channels) in a submodule."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.block = torch.nn.Sequential(torch.nn.ReLU(), _Sorter())
        self.fc2 = torch.nn.Linear(8, 3)
        self.fc3 = torch.nn.Linear(3, 5)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.block(self.fc1(x)))))


def test_strict_raises_naming_the_op():
    with pytest.raises(symgraph.UnsupportedOpError, match=r"aten\.sort") as e:
        symgraph.analyze(_Unruled(), inputs=(torch.randn(2, 4),), strict=True)
    assert "block.1" in str(e.value)  # the module path


def test_frozen_entries_name_op_node_module():
    model = _Unruled()
    x = torch.randn(2, 4)
    report = symgraph.analyze(model, inputs=(x,))
    f = one(report.frozen, "frozen op")
    assert f.op == "aten.sort.default"
    assert f.node.startswith("sort")
    assert f.module == "block.1"
    assert "torch.sort" in f.source
    assert f.to_dict() == {"op": f.op, "node": f.node, "module": f.module, "source": f.source}
    # the sort freezes fc1's outputs, but fc2 -> fc3 still has its (scaled) permutation
    assert [(g.kind, g.size, sorted(g.params)) for g in report.groups] == [
        ("scaled_perm", 3, [("fc2.bias", 0), ("fc2.weight", 0), ("fc3.weight", 1)])]
    assert "aten.sort.default" in report.summary() and "block.1" in report.summary()
    assert report.certify(model, inputs=(x,)) <= TOL


def test_to_json_round_trip(bert):
    d = json.loads(bert.report.to_json())
    assert d["model"] == "BertForMaskedLM"
    assert len(d["groups"]) == len(bert.report.groups)
    assert d["degrees_of_freedom"] == bert.report.degrees_of_freedom > 0
    assert d["frozen"] == []
    for g, j in zip(bert.report.groups, d["groups"]):
        assert {"kind", "size", "blocks", "params", "module"} <= j.keys()
        assert (j["kind"], j["size"], j["blocks"], j["module"]) == (g.kind, g.size, g.blocks, g.module)
        assert [tuple(p) for p in j["params"]] == g.params
        assert j["variance"] == g.variance and j["outer"] == g.outer


def test_to_json_frozen_fields():
    d = json.loads(symgraph.analyze(_Unruled(), inputs=(torch.randn(2, 4),)).to_json())
    assert [f["op"] for f in d["frozen"]] == ["aten.sort.default"]
    assert d["frozen"][0]["module"] == "block.1" and d["frozen"][0]["node"]


@pytest.mark.parametrize("ext", [".dot", ".png"])
def test_save_graph(bert, tmp_path, ext):
    path = tmp_path / ("g" + ext)
    assert bert.report.save_graph(str(path)) == str(path)
    data = path.read_bytes()
    assert len(data) > 100
    if ext == ".dot":
        text = data.decode()
        assert text.startswith("digraph")
        assert text.count("[label=") >= len(bert.report.groups)
    else:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.iterdir()) == [path]  # written atomically: no temporary left behind


def test_save_graph_unknown_format(bert, tmp_path):
    with pytest.raises(symgraph.InputError):
        bert.report.save_graph(str(tmp_path / "g.txt"))


@pytest.mark.parametrize("tiny", ["bert", "llama"], indirect=True)
def test_summary_mentions_each_module(tiny):
    text = tiny.report.summary()
    assert text.startswith(f"Symmetry report for {type(tiny.model).__name__}: {len(tiny.report.groups)} groups")
    for g in tiny.report.groups:
        assert (g.module or "(model)") in text
        assert f"{g.kind:<12}" in text
    layers = tiny.config.num_hidden_layers
    prefix = MLP[tiny.name][0]
    for i in range(layers):
        assert prefix.format(i=i).rstrip(".") in text


def test_model_left_unchanged():
    model, cfg = build_hf("gpt2", seed=3)
    model.train()
    model.transformer.h[0].eval()  # a mix of flags, which must come back exactly
    flags = [m.training for m in model.modules()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = symgraph.analyze(model)
    assert [m.training for m in model.modules()] == flags
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in model.parameters())
    assert len(report.groups) > 0


@pytest.mark.parametrize("bad", [3, "input", 1.5, {1, 2}])
def test_bad_inputs_type(bad):
    model, _, _ = build_mlp()
    with pytest.raises(symgraph.InputError, match="inputs must be"):
        symgraph.analyze(model, inputs=bad)


def test_missing_inputs_for_plain_module():
    model, _, _ = build_mlp()
    with pytest.raises(symgraph.InputError, match="pass inputs="):
        symgraph.analyze(model)


def test_not_a_module():
    with pytest.raises(symgraph.InputError, match="torch.nn.Module"):
        symgraph.analyze(lambda x: x, inputs=(torch.randn(2),))


def test_dict_inputs_equivalent_to_default(gpt2):
    ids = gpt2.report._inputs[1]["input_ids"]
    report = symgraph.analyze(gpt2.model, inputs={"input_ids": ids})
    assert _structure(report) == _structure(gpt2.report)


def test_randomized_vectors_are_not_trivial(bert):
    # the fixtures' norm weights and biases are random (see conftest), so a permutation of
    # them is visible in the certificate
    ln = bert.model.bert.embeddings.LayerNorm
    assert ln.weight.std() > 0.1 and ln.bias.abs().max() > 0.1


class _NoDouble(torch.nn.Module):
    """An MLP with an op that has no float64 kernel (as grouped expert matmuls had)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError('"grouped_mm" not implemented for \'Double\'')
        return self.down(torch.relu(self.up(x)))


def test_model_without_float64_kernels_certifies_in_float32():
    """The certificate runs in float32 against FLOAT32_TOL and says so (it used to crash)."""
    model, x = _NoDouble().eval(), torch.randn(4, 6)
    report = symgraph.analyze(model, (x,))
    with pytest.warns(UserWarning, match="certified in float32"):
        worst = report.certify(model)
    assert 0 < worst < symgraph.report.symmetry.FLOAT32_TOL
    assert [(g.kind, g.size) for g in report.groups] == [("scaled_perm", 10)]


class _ExpertsNoDouble(_NoDouble):
    """Like Hugging Face's experts: no float64 kernel until its eager loop is chosen."""
    eager = False

    def set_experts_implementation(self, name):
        self.eager = name == "eager"

    def forward(self, x):
        if self.eager:
            return self.down(torch.relu(self.up(x)))
        return super().forward(x)


def test_experts_certify_in_float64_through_their_eager_loop():
    """A model whose grouped matmul has no float64 kernel but which can switch to its eager
    experts loop (``set_experts_implementation``) is certified in float64, with no warning;
    the model passed in is not switched."""
    import warnings
    model, x = _ExpertsNoDouble().eval(), torch.randn(4, 6)
    report = symgraph.analyze(model, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worst = report.certify(model)
    assert worst < 1e-12 and not model.eager


def test_mixtral_certifies_in_float64():
    """Mixtral on torch 2.13's CPU: float64 throughout (Hugging Face's router softmax runs in
    float32, hence a float32-level deviation), no float32 fallback."""
    import warnings
    from symgraph.testing import models
    model = models.build("mixtral", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worst = symgraph.analyze(model).certify(model)
    assert worst < 1e-6

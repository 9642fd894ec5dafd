"""The Python API refuses, in one line naming the option and what it expects, arguments it used
to crash on inside (AttributeError, TypeError, a torch error) or silently ignore (an option of a
step that does not run)."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import InputError, StructureMismatchError
from symgraph.merging import MergeMethod, register
from symgraph.merging.methods import registry
from symgraph.testing import models

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair():
    return models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)


def ids(*shape):
    return torch.randint(2, 64, shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("data, says", [
    (ids(8, 12), "data is a Tensor; expected a list of batches"),
    ({"input_ids": ids(8, 12)}, "data is a dict"),
    ("file.safetensors", "data is a str"),
    ([{"input_ids": ids(12)}], r"'input_ids' of data\[0\] has shape \(12,\); expected a batch of sequences"),
    ([{"input_ids": ids(0, 12)}], r"has shape \(0, 12\)"),
    ([{"input_ids": ids(8, 12).to("meta")}], "on the meta device"),
    ([{"input_ids": ids(2, 6), "attention_mask": torch.full((2, 6), 2)}], "values other than 0 and 1"),
])
def test_data_of_the_wrong_form(pair, data, says):
    with pytest.raises(InputError, match=says):
        symgraph.merge(list(pair), data=data, align="activations")


@pytest.mark.parametrize("kw, says", [
    (dict(out="merged"), "out= is an option of a merge written to disk"),
    (dict(memory_budget="1MB"), "memory_budget= is an option of a merge written to disk"),
    (dict(progress="x"), "progress='x'; expected True or False"),
    (dict(align=None, solver="ot"), "solver= is an option of the alignment, and align=None aligns nothing"),
    (dict(reg=0.1), "reg=0.1 is the entropic regularisation of solver='sinkhorn'"),
    (dict(method=3), "method=3; expected a registered method's name"),
    (dict(method="regmean", method_options=0.5), "method_options is a float"),
    (dict(anchor="universe", universe_options=3), "universe_options is a int"),
])
def test_merge_options(pair, kw, says):
    with pytest.raises(InputError, match=says):
        symgraph.merge(list(pair), **kw)


def test_align_options(pair):
    a, b = pair
    for kw, says in ((dict(loss_fn=lambda m, bt: 0), "loss_fn= is an option of learned matching"),
                     (dict(refine_lr=0.1), "refine_lr= is an option of learned matching"),
                     (dict(report_a="x"), "report_a is a str; expected a SymmetryReport")):
        with pytest.raises(InputError, match=says):
            symgraph.align(a, b, **kw)
    with pytest.raises(InputError, match="alpha=-1; expected a number in"):
        symgraph.compare(a, b, alpha=-1)


def test_other_depths_name_the_config_field(pair):
    deeper = models.build("llama", seed=2, **{**L, "layers": 3})
    with pytest.raises(StructureMismatchError, match="configs differ: num_hidden_layers 2 vs 3"):
        symgraph.merge([pair[0], deeper])


def test_analyze_rotate_and_transform_options(pair):
    a = pair[0]
    with pytest.raises(InputError, match="strict='yes'; expected True or False"):
        symgraph.analyze(a, strict="yes")
    with pytest.raises(InputError, match="seed= 'x'"):
        symgraph.analyze(a).random_transform(seed="x")
    with pytest.raises(InputError, match="tol=-1; expected a positive number"):
        symgraph.rotate(a, tol=-1)
    data = [{"input_ids": ids(2, 8)}]
    for kw, says in ((dict(lr=-1.0), "lr=-1.0; expected a positive step size"),
                     (dict(act_bits=1), "act_bits=1; expected a number of bits from 2 to 16"),
                     (dict(weight_bits=0), "weight_bits=0"), (dict(group_size=0), "group_size=0")):
        with pytest.raises(InputError, match=says):
            symgraph.rotate(a, how="learned", data=data, steps=1, **kw)
    assert symgraph.rotate(a, classes="stream").roles.keys() == {"stream"}  # one class by its name


def test_merge_checkpoints_paths(tmp_path):
    with pytest.raises(InputError, match="paths is a str; expected a list"):
        symgraph.merge_checkpoints("a", tmp_path / "o")
    with pytest.raises(InputError, match="out=None; expected the output directory's path"):
        symgraph.merge_checkpoints(["a", "b"], None)


def test_registered_methods_are_checked(pair):
    with pytest.raises(InputError, match="'average' is registered already"):
        @register("average")
        class Mine(MergeMethod):
            pass
    with pytest.raises(InputError, match="expected a method's name"):
        register(3)

    try:
        _bad_methods(pair)
    finally:  # the registry is the process's: leave it as it was for other tests
        for name in ("first_row_test", "dropping_test"):
            registry._METHODS.pop(name, None)


def _bad_methods(pair):
    @register("first_row_test")
    class Rows(MergeMethod):
        def combine_group(self, names, values, stats, weights, report):
            return {k: values[0][k][:1] for k in names}

    @register("dropping_test")
    class Dropping(MergeMethod):
        def combine_group(self, names, values, stats, weights, report):
            return {k: values[0][k] for k in names[1:]}
    with pytest.raises(InputError, match=r"returned shape \(1, 32\) for 'model.embed_tokens.weight'; expected \(64, 32\)"):
        symgraph.merge(list(pair), method="first_row_test", align=None)
    with pytest.raises(InputError, match="returned NoneType for 'model.embed_tokens.weight'"):
        symgraph.merge(list(pair), method="dropping_test", align=None)

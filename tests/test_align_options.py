"""``AlignOptions`` is one frozen, typed schema whose fields carry their range and description,
and the merge configuration's alignment fields are derived from its declarations: the same
type, default and range, so that ``symgraph.align`` and ``symgraph merge`` accept and refuse
the same values, each refusal one line naming the option, the value and what is expected."""
from __future__ import annotations

import pydantic
import pytest
import torch

import symgraph
from symgraph import AlignOptions
from symgraph.errors import InputError
from symgraph.app.config import MergeConfig, merge_options

#: The fields both schemas declare, with values each must accept and refuse alike.
SHARED = {
    "refine": ([0, 3, 1_000_000], [-1, 1_000_001, 1.5, True, "3", None]),
    "fold_norms": ([True, False], [1, "yes", None]),
    "full_groups": ([True, False], [0, "no", None]),
    "sketch": ([0, 64], [-1, 2.0, False, "8", None]),
    "tol": ([0, 0.0, 0.25, 0.999], [1.0, 1, -0.1, float("nan"), float("inf"), True, "0.1", None]),
    "outputs": ([None, ["logits"], ["logits", "hidden"]], [[], "logits", [["logits"]], [1.5]]),
}


def test_every_shared_field_is_declared_once():
    for key in SHARED:
        a, m = AlignOptions.model_fields[key], MergeConfig.model_fields[key]
        assert m.annotation == a.annotation and m.metadata == a.metadata, key  # type and range
        assert m.default == a.default, key
        assert m.description and a.description, key  # each its own words (the CLI's, the API's)


def _merge_cfg(key, value):
    # data given: the rules between options (refine needs data) are not what this compares
    return MergeConfig.model_validate({"models": ["a", "b"], "data": "d.safetensors", key: value})


@pytest.mark.parametrize("key", sorted(SHARED))
def test_shared_fields_accept_and_refuse_the_same_values(key):
    good, bad = SHARED[key]
    for v in good:
        assert getattr(AlignOptions(**{key: v}), key) == getattr(_merge_cfg(key, v), key), (key, v)
    for v in bad:
        with pytest.raises(InputError) as e:
            AlignOptions(**{key: v})
        said = str(e.value)
        assert said.startswith(f"{key}=") and "expected" in said and "\n" not in said, said
        with pytest.raises(pydantic.ValidationError):
            _merge_cfg(key, v)


def test_the_command_line_refuses_what_align_refuses():
    base = {"models": ["a", "b"], "out": "o"}
    for key, value, needle in (("tol", 1.0, "--tol 1.0; expected a relative gain in [0, 1)"),
                               ("sketch", -1, "--sketch -1; expected 0 (exact) to 1048576 projection columns"),
                               ("refine", -2, "--refine -2; expected a number of steps")):
        with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            merge_options({**base, key: value})
        with pytest.raises(InputError, match=f"{key}="):
            AlignOptions(**{key: value})


def test_refusals_are_one_line_naming_the_field_the_value_and_what_is_expected():
    cases = {"solver": "exact", "inner": "greedy", "max_iter": 0, "masses": "mass", "similarity": "fp8",
             "block_scale": "rows", "head_cost": "cosine", "reg": 0.0, "refine_lr": -1e-3, "rescale": "yes",
             "defer": 1, "loss_fn": "ce", "between": 3, "groups": "attn",
             "rows": {"transformer.wte.weight": torch.zeros(2, 3, dtype=torch.long)}}
    for key, value in cases.items():
        with pytest.raises(InputError) as e:
            AlignOptions(**{key: value})
        said = str(e.value)
        assert said.startswith(f"{key}=") and "; expected " in said and "\n" not in said, said
    with pytest.raises(InputError, match=r"rows=.*maps 'w' to a 1-D float32 tensor.*1-D integer index tensors"):
        AlignOptions(rows={"w": torch.zeros(3)})
    with pytest.raises(InputError, match="unknown align option 'solvr'; expected some of .*'solver'"):
        AlignOptions(solvr="ot")


def test_build_replaces_fields_and_refuses_unknown_ones():
    base = AlignOptions(tol=0.25, sketch=8)
    opts = AlignOptions.build(base, sketch=0, outputs=("logits",))
    assert (opts.tol, opts.sketch, opts.outputs) == (0.25, 0, ["logits"])  # a tuple is read as a list
    assert AlignOptions.build(base) is base and AlignOptions.build().tol == 0
    with pytest.raises(InputError, match=r"unknown align option\(s\) \['sktch'\]; expected some of .*'sketch'"):
        AlignOptions.build(base, sktch=4)
    with pytest.raises(InputError, match="options is a dict; expected an AlignOptions"):
        AlignOptions.build({"tol": 0.1})
    with pytest.raises(pydantic.ValidationError):
        opts.tol = 0.5  # frozen
    assert opts.selected(object()) and not AlignOptions(groups=lambda g: False).selected(object())


def test_every_field_is_described_and_the_public_name_is_the_schema():
    assert symgraph.AlignOptions is AlignOptions
    from symgraph.alignment.driver import AlignOptions as from_driver
    assert from_driver is AlignOptions
    for key, f in AlignOptions.model_fields.items():
        assert f.description and len(f.description) > 20, key
        assert isinstance(f.json_schema_extra, dict) and f.json_schema_extra["expected"], key

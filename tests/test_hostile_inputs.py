"""Hostile inputs a new user's hour found (issues 61/65): ``merge()`` given something that is
not a list of models in memory, a ``.pt`` data file whose pickle would run code, a config naming
a model type transformers does not know. Each is refused in one line that names what was wrong
and what was expected, quoting a library's message only as far as it is about the input (never
torch's advice to load the file with ``weights_only=False``, never a word cut in half)."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import symgraph
from symgraph.checkpoints.loading import read_config
from symgraph.checkpoints.specs import load_data
from symgraph.core.schema import quoted
from symgraph.testing import models

L = dict(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=24, positions=32)


def test_merge_refuses_what_is_not_a_model_in_memory():
    m = models.build("llama", seed=0, **L)
    with pytest.raises(symgraph.InputError) as e:
        symgraph.merge([m, "b"])
    assert str(e.value) == ("models[1] is a str; expected a torch.nn.Module in memory (merge "
                            "checkpoints on disk with symgraph.merge_checkpoints)")
    with pytest.raises(symgraph.InputError) as e:
        symgraph.merge([m, None])
    assert str(e.value).startswith("models[1] is a NoneType; expected a torch.nn.Module")
    for one in (m, torch.nn.Sequential(m, models.build("llama", seed=1, **L))):  # not a list of models
        with pytest.raises(symgraph.InputError) as e:
            symgraph.merge(one)
        assert str(e.value) == (f"models is a {type(one).__name__}; expected a list of torch.nn.Module "
                                "models (at least 2)")


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (8,)])
def test_token_ids_without_a_row_or_a_token_are_refused_saying_so(tmp_path, shape):
    from safetensors.torch import save_file
    path = str(tmp_path / "ids.safetensors")
    save_file({"input_ids": torch.zeros(shape, dtype=torch.long)}, path)
    with pytest.raises(symgraph.InputError) as e:
        load_data(path)
    assert str(e.value) == (f"'input_ids' in {path!r} has shape {shape}; expected a 2-d tensor [N, S] of token "
                            "ids (N ≥ 1 rows of S ≥ 1 tokens)")


def test_a_nan_checkpoint_loaded_whole_is_named_once_quoted(tmp_path):
    from symgraph.checkpoints.loading import load_local
    m = models.build("llama", seed=0, **L)
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    m.save_pretrained(tmp_path / "nan")
    path = str(tmp_path / "nan")
    with pytest.raises(symgraph.InputError) as e:
        load_local(path)
    assert str(e.value) == (f"checkpoint {path!r} has 1 NaN/inf values in tensor 'model.layers.0.mlp.up_proj."
                            "weight'; expected finite weights (was the model trained with a diverging loss?)")


def test_transform_refuses_what_is_not_a_model_or_an_element():
    m = models.build("llama", seed=0, **L)
    t = symgraph.analyze(m).random_transform()
    with pytest.raises(symgraph.InputError) as e:
        symgraph.transform(m, None)
    assert str(e.value) == "transform's t is a NoneType; expected a Transform (such as report.random_transform())"
    with pytest.raises(symgraph.InputError) as e:
        symgraph.transform("a", t)
    assert str(e.value) == "transform's model is a str; expected a torch.nn.Module"


def test_merge_checkpoints_names_its_keywords_not_the_flags(tmp_path):
    paths, out = [str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out")
    with pytest.raises(symgraph.InputError) as e:
        symgraph.merge_checkpoints(paths, out, memory_budget=0)
    assert str(e.value) == "memory_budget 0; expected a size such as '2GB' or '500MB', above 0 and at most 1000000GB"
    with pytest.raises(symgraph.InputError) as e:
        symgraph.merge_checkpoints(paths, out, max_iter=0)
    assert str(e.value) == "max_iter 0; expected a number of sweeps (an integer >= 1, at most 1000)"
    assert not os.path.exists(out)


def test_a_stale_config_dtype_is_replaced_by_the_tensors(tmp_path):
    for seed in (0, 1):
        models.build("llama", seed=seed, **L).save_pretrained(tmp_path / f"m{seed}")
    cfg_path = tmp_path / "m0" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["dtype"] == "float32"
    cfg_path.write_text(json.dumps({**cfg, "dtype": "float8_e4m3fn"}))  # float32 tensors
    symgraph.merge_checkpoints([str(tmp_path / "m0"), str(tmp_path / "m1")], str(tmp_path / "o"), align=None)
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float32"
    merged = type(models.build("llama", seed=0, **L)).from_pretrained(tmp_path / "o")  # failed on the stale dtype
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    symgraph.merge_checkpoints([str(tmp_path / "m1"), str(tmp_path / "m0")], str(tmp_path / "p"), align=None)
    assert (tmp_path / "p" / "config.json").read_bytes() == (tmp_path / "m1" / "config.json").read_bytes()


def test_a_mixed_checkpoint_keeps_a_config_dtype_it_has(tmp_path):
    from safetensors.torch import load_file, save_file
    for seed in (0, 1):
        models.build("llama", seed=seed, **L).save_pretrained(tmp_path / f"m{seed}")
    weights = tmp_path / "m0" / "model.safetensors"
    sd = load_file(weights)
    halves = sorted(sd)[: len(sd) // 2 + 1]  # most tensors float16, the config still says float32
    save_file({k: v.half() if k in halves else v for k, v in sd.items()}, weights, metadata={"format": "pt"})
    symgraph.merge_checkpoints([str(tmp_path / "m0"), str(tmp_path / "m1")], str(tmp_path / "o"), align=None)
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float32"


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_that_runs_code_is_refused_without_torchs_advice(tmp_path):
    ran = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"input_ids": _Touch(ran)}))
    with pytest.raises(symgraph.InputError) as e:
        load_data(str(path))
    assert str(e.value) == (f"cannot read data file {str(path)!r} with weights_only=True (symgraph runs no code "
                            "from a file): Unsupported operand 149; expected a dict of tensors or a tensor")
    assert not ran.exists()


def test_an_unknown_model_type_is_quoted_to_its_first_sentence(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "architectures": ["EvilModel"]}))
    with pytest.raises(symgraph.InputError) as e:
        read_config(str(tmp_path))
    assert str(e.value) == (f"cannot read {tmp_path}/config.json: The checkpoint you are trying to load has model "
                            "type `evil` but Transformers does not recognize this architecture.; expected a "
                            "Hugging Face config written by save_pretrained")


def test_quoted_keeps_whole_sentences_or_cuts_at_a_word():
    assert quoted(ValueError("one  line\nof text")) == "one line of text"
    assert quoted(ValueError()) == "ValueError"
    assert quoted("First sentence. " + "x" * 300, 40) == "First sentence."
    assert quoted("alpha beta gamma delta", 12) == "alpha beta ..."
    assert quoted("y" * 30, 10) == "y" * 10 + " ..."


def test_a_singular_rope_element_is_named_singular():
    """A RoPE element with a zero row is refused for that (its rows' off-diagonal can be tiny)."""
    import torch
    from symgraph.alignment.checks import ElementGroup, check_element
    el = torch.eye(8, dtype=torch.float64).expand(2, 8, 8).clone()
    el[0, 0] = 0
    with pytest.raises(symgraph.InputError, match="a row is zero \\(the block is singular\\)"):
        check_element(el, ElementGroup(id=1, kind="rope", dim=8, blocks=2, stack=(2,)))

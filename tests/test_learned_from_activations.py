"""Learned matching starts from activation matching, decided once: the config's validator
(``MergeConfig._learned_from_activations`` and :func:`symgraph.merging.config.check`). ``refine``
with no ``align`` given aligns by activations on every entry (``MergeConfig``, the command line
and YAML, ``symgraph.merge``, ``merge_checkpoints``, the engine); any other ``align`` given is
refused in one line, never silently replaced (``align="weights"`` too, the value an unset ``align``
otherwise takes: a keyword left unset is :data:`symgraph.core.schema.UNSET`).
``symgraph.merge(refine=N)`` with ``align`` left unset merges exactly as ``align="activations"`` does."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.app.config import MergeConfig, build_config, merge_options
from symgraph.app.run import merge_checkpoints
from symgraph.cli.main import main
from symgraph.errors import InputError
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

L = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)
SAID = "starts from activation matching"


def _batches(n=2):
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (2, 6), generator=g)} for _ in range(n)]


def test_refine_without_align_is_activation_matching_in_every_config():
    cfg = MergeConfig(models=["a", "b"], refine=3, data="d.pt")
    assert (cfg.align, cfg.refine, cfg.takes_statistics) == ("activations", 3, True)
    assert build_config(dict(models=["a", "b"], refine=2), batches=True).align == "activations"
    assert MergeConfig(models=["a", "b"], data="d.pt").align == "weights"  # no refine: the default stands
    assert MergeConfig(models=["a", "b"], refine=0).align == "weights"


@pytest.mark.parametrize("align", ["weights", "none"])
def test_refine_with_another_align_given_is_refused_in_one_line(align):
    with pytest.raises(InputError) as e:
        MergeConfig(models=["a", "b"], refine=3, data="d.pt", align=align)
    assert str(e.value) == f"--refine {SAID}, and --align says {align}; expected --align activations"
    with pytest.raises(InputError, match=rf"^refine starts from .*and align says {align}; expected align activ"):
        StreamingMerge(["a", "b"], refine=2, align=align, data=_batches())


def test_the_command_line_and_yaml_name_where_each_option_came_from(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text("models: [a, b]\nrefine: 2\nout: o\n")
    cfg = merge_options({"config": str(tmp_path / "m.yaml"), "data": "d.pt"})
    assert (cfg.align, cfg.refine) == ("activations", 2)
    with pytest.raises(InputError, match=rf"^'refine:' in \S*m.yaml {SAID[:20]}.*, and --align says weights"):
        merge_options({"config": str(tmp_path / "m.yaml"), "data": "d.pt", "align": "weights"})
    (tmp_path / "w.yaml").write_text("models: [a, b]\nalign: none\nout: o\n")
    said = r"^--refine .*, and 'align:' in \S*w.yaml says none; expected align activations$"
    with pytest.raises(InputError, match=said):
        merge_options({"config": str(tmp_path / "w.yaml"), "data": "d.pt", "refine": 2})
    rc = main(["merge", "a", "b", "--out", str(tmp_path / "o"), "--data", "d.pt", "--refine", "2", "--align",
               "weights"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"symgraph: --refine {SAID}, and --align says weights; expected --align activations\n"
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def pair():
    return models.build("llama", seed=0, **L), models.build("llama", seed=1, **L)


def test_merge_refine_with_align_at_its_default_is_the_activations_merge(pair):
    A, B = pair
    data = _batches()
    got = symgraph.merge([A, B], data=data, refine=2)
    want = symgraph.merge([A, B], data=data, refine=2, align="activations")
    assert got.alignments[1].similarity == "activations" and got.alignments[1].refined["steps"] == 2
    g, w = got.model.state_dict(), want.model.state_dict()
    assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    plain = symgraph.merge([A, B], data=data, align="activations").model.state_dict()
    assert any(not torch.equal(g[k], plain[k]) for k in w)  # the steps did move B
    for given, said in ((None, "none"), ("weights", "weights")):  # "weights", the default value, given
        with pytest.raises(InputError) as e:
            symgraph.merge([A, B], data=data, refine=2, align=given)
        assert str(e.value) == f"refine {SAID}, and align says {said}; expected align activations"


def test_merge_checkpoints_and_the_engine_take_refine_without_align(pair, tmp_path):
    for i, m in enumerate(pair):
        m.save_pretrained(tmp_path / f"m{i}")
    paths = [str(tmp_path / "m0"), str(tmp_path / "m1")]
    assert StreamingMerge(paths, refine=2, data=_batches()).config.align == "activations"  # was refused
    job = merge_checkpoints(paths, str(tmp_path / "o"), refine=2, data=_batches())
    assert job.config.align == "activations" and job.alignments[1].refined["steps"] == 2
    for given, said in ((None, "none"), ("weights", "weights")):
        with pytest.raises(InputError) as e:
            merge_checkpoints(paths, str(tmp_path / "p"), align=given, refine=2, data=_batches())
        assert str(e.value) == f"refine {SAID}, and align says {said}; expected align activations"  # as merge()
    assert not (tmp_path / "p").exists()

"""A tied model beside its untied form (``symgraph rotate`` unties a tied head): one function, so
``compare`` and ``align`` take the pair through the tied one untied, and ``merge`` does so with
``--untie`` (``untie=True``) and refuses without it, in one line naming the option; ``apply``
reads a tied fine-tune untied where the alignment was solved for B's untied form. Before,
every one of them refused the pair as two architectures (``lm_head.weight`` missing vs
present), although ``symgraph rotate``'s own output was the second model."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import symgraph
from symgraph.cli.compare import compare_paths
from symgraph.cli.main import main as cli
from symgraph.core.ties import parameter_names, side_to_untie
from symgraph.errors import InputError
from symgraph.testing import models

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, mlp=48, positions=64)
HEAD = "lm_head.weight"


def _logits(m, x):
    with torch.no_grad():
        return m.eval()(x).logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tied GPT-2 (``a``), its rotated copy (its head untied: ``r``), and another seed's model
    (``b``), in memory and as ``save_pretrained`` directories."""
    d = tmp_path_factory.mktemp("untied")
    a, b = (models.build("gpt2", seed=s, **SIZES) for s in (0, 1))
    r = symgraph.rotate(a).model
    assert a.config.tie_word_embeddings and not r.config.tie_word_embeddings
    for name, m in (("a", a), ("b", b), ("r", r)):
        m.save_pretrained(str(d / name))
    return d, a, b, r


def test_the_side_to_untie_is_the_tied_one(pair):
    _, a, b, r = pair
    na, nr = parameter_names(a), parameter_names(r)
    assert HEAD not in na and HEAD in nr
    assert side_to_untie(na, nr) == 0 and side_to_untie(nr, na) == 1
    assert side_to_untie(na, parameter_names(b)) is None  # both tied: nothing to untie
    assert side_to_untie(nr, nr) is None
    extra = dict(nr, **{"extra.weight": ["extra.weight"]})  # more than the tied names: another model
    assert side_to_untie(na, extra) is None


def test_compare_in_memory_finds_the_rotated_copy_the_same(pair):
    _, a, b, r = pair
    for x, y, side in ((a, r, "A"), (r, a, "B")):
        res = symgraph.compare(x, y, null=0)
        assert res.verdict == "same" and res.max_rel_distance < 1e-6
        assert res.untied == {side: [HEAD]}
        assert f"{side}'s tied parameters untied to compare" in res.summary()
        assert json.loads(res.to_json())["untied"] == {side: [HEAD]}
    assert symgraph.compare(b, r, null=2).verdict == "unrelated"  # another seed stays unrelated
    assert HEAD not in parameter_names(a)  # the inputs are left tied


def test_compare_out_of_core_says_the_same(pair):
    d, *_ = pair
    res = compare_paths(str(d / "r"), str(d / "a"), null=0, out_of_core=True)
    assert res.mode == "out of core" and res.verdict == "same" and res.max_rel_distance < 1e-6
    assert res.untied == {"B": [HEAD]}


def test_merge_refuses_the_pair_without_untie_and_merges_it_with(pair, tmp_path, capsys):
    d, a, _, r = pair
    assert cli(["merge", str(d / "a"), str(d / "r"), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "ties its output head to its input embedding" in err and "--untie" in err
    assert not (tmp_path / "no").exists()
    with pytest.raises(InputError, match=r"untie=True"):
        symgraph.merge([a, r])
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    ref = _logits(a, x)
    for order in (("a", "r"), ("r", "a")):
        out = tmp_path / "".join(order)
        assert cli(["merge", *(str(d / n) for n in order), "--untie", "--out", str(out)]) == 0
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(str(out))
        assert not m.config.tie_word_embeddings
        assert (_logits(m, x) - ref).abs().max() < 1e-5 * ref.abs().max()  # a moved copy merges to A
    res = symgraph.merge([r, a], untie=True)
    assert (_logits(res.model, x) - ref).abs().max() < 1e-5 * ref.abs().max()


def test_align_writes_the_tied_model_untied_in_the_rotated_basis(pair, tmp_path):
    from transformers import AutoModelForCausalLM
    d, a, b, r = pair
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    assert cli(["align", str(d / "r"), str(d / "b"), "--out", str(tmp_path / "b_in_r")]) == 0
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b_in_r"))
    assert not m.config.tie_word_embeddings and m.lm_head.weight is not m.transformer.wte.weight
    ref = _logits(b, x)
    assert (_logits(m, x) - ref).abs().max() < 1e-5 * ref.abs().max()  # B's function, untied
    record = json.loads((tmp_path / "b_in_r" / "symgraph_align.json").read_text())
    assert record["symgraph_align"]["untied"] == {"B": [HEAD]}
    tuned = copy.deepcopy(b)  # a tied fine-tune of B: the saved alignment carries it too, untied
    with torch.no_grad():
        for q in tuned.parameters():
            q.add_(0.01 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())))
    tuned.save_pretrained(str(tmp_path / "tuned"))
    assert cli(["apply", str(tmp_path / "b_in_r" / "symgraph_alignment.safetensors"), str(tmp_path / "tuned"),
                "--out", str(tmp_path / "tuned_in_r")]) == 0
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned_in_r"))
    assert not m.config.tie_word_embeddings
    ref = _logits(tuned, x)
    assert (_logits(m, x) - ref).abs().max() < 1e-5 * ref.abs().max()
    assert json.loads((tmp_path / "tuned_in_r" / "symgraph_apply.json").read_text())["symgraph_apply"]["untied"]
    assert cli(["align", str(d / "a"), str(d / "r"), "--out", str(tmp_path / "r_in_a")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "r_in_a")).state_dict()
    mine = a.state_dict()
    moved = [k for k in mine if k in back and k != HEAD and mine[k].is_floating_point()]
    assert len(moved) > 10 and max(float((back[k] - mine[k]).abs().max()) for k in moved) < 1e-5  # A recovered

"""``compare`` across widths (issue 45): B of A's architecture but other class widths is carried
into A's shapes by the alignment's transport maps and measured there, and so is each shuffled
copy of the null. A width-pruned copy of A (MLP units removed), randomly transformed, is
"derived" — never "same", even when the map undoes a widening exactly; a model of the smaller
width trained on its own is "unrelated"; shapes that differ along an axis no class maps (the
vocabulary) are refused in one line, in memory and out of core. Tiny one-layer LLaMAs, trained
for a few steps on one synthetic language so that "unrelated" pairs share what training gives."""
from __future__ import annotations

import json

import pytest
import torch

import symgraph
from symgraph.cli.main import main
from symgraph.testing import models

from conftest import successor_sampler

L = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)
NARROW = 40


def _trained(seed, data_seed, **kw):
    m = models.build("llama", seed=seed, **{**L, **kw})
    models.train(m, successor_sampler(data_seed), steps=15, lr=3e-3)
    return m


def _pruned(model, keep):
    """``model`` with only the units ``keep`` of every axis whose width is ``L["mlp"]``, read
    from the shapes (no parameter names): a copy of the narrower architecture."""
    small = models.build("llama", seed=0, **{**L, "mlp": len(keep)})
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in small.named_parameters():
            t = own[name]
            for d, (x, y) in enumerate(zip(t.shape, p.shape)):
                if x != y:
                    t = t.index_select(d, keep)
            p.copy_(t)
    return small


def _moved(model, seed):
    """``model`` moved by a random element of every group of its own report."""
    return symgraph.transform(model, symgraph.analyze(model).random_transform(seed=seed))


@pytest.fixture(scope="module")
def trio():
    a = _trained(0, 7)
    keep = torch.randperm(L["mlp"], generator=torch.Generator().manual_seed(3))[:NARROW].sort().values
    pruned = _moved(_pruned(a, keep), 4)
    other = _trained(5, 8, mlp=NARROW)
    return a, pruned, other


@pytest.fixture(scope="module")
def dirs(trio, tmp_path_factory):
    root = tmp_path_factory.mktemp("widths")
    a, pruned, other = trio
    a.save_pretrained(root / "a")
    pruned.save_pretrained(root / "pruned")
    other.save_pretrained(root / "other")
    models.build("llama", seed=1, **{**L, "vocab": 48}).save_pretrained(root / "vocab")
    return root


def test_a_width_pruned_transformed_copy_is_derived(trio):
    a, pruned, _ = trio
    res = symgraph.compare(a, pruned, null=2)
    assert res.verdict == "derived" and res.excess >= res.threshold and res.p_value < res.alpha
    assert res.excess > 0.9 and res.null_mean < 0.5 and len(res.null) == 2
    # the widths that differ, and B carried into A's shapes through the transport map
    assert set(res.widths) == {n for n, p in a.named_parameters() if L["mlp"] in p.shape}
    assert res.widths["model.layers.0.mlp.down_proj.weight"] == ((32, 48), (32, 40))
    rows = {t["name"]: t for t in res.tensors}
    assert all(rows[n]["shape"] == list(p.shape) for n, p in a.named_parameters())
    # the pruned tensors match A's kept units; the 8 removed units are filled by the map
    assert all(0.85 < rows[n]["correlation"] < 0.99 for n in res.widths), \
        {n: rows[n]["correlation"] for n in res.widths}
    assert all(rows[n]["correlation"] > 0.999 for n in rows if n not in res.widths and not rows[n]["gauge"])
    assert "widths differ: at most derived" in res.summary() and "transport maps" in res.summary()
    assert res.to_dict()["widths"]["model.layers.0.mlp.up_proj.weight"] == [[48, 32], [40, 32]]
    assert {"perm", "orthogonal"} <= set(res.group_kinds())
    applied = res.alignment.apply(pruned)  # A's architecture, B's function moved into it
    assert {n: tuple(p.shape) for n, p in applied.named_parameters()} == \
        {n: tuple(p.shape) for n, p in a.named_parameters()}


def test_an_unrelated_narrower_model_is_unrelated(trio):
    a, _, other = trio
    res = symgraph.compare(a, other, null=2)
    assert res.verdict == "unrelated" and res.excess < res.threshold, res.summary()
    assert res.statistic < 0.6 and len(res.widths) == 3
    assert "widths differ: at most derived" in res.summary()


def test_across_widths_an_exact_map_is_still_at_most_derived(trio):
    """A function-preserving widening of A (units copied, outgoing weights split): the
    transport map undoes it exactly, yet the verdict is "derived", never "same"."""
    from symgraph.width.resize import resize
    a = trio[0]
    mlp = [g.id for g in symgraph.analyze(a).groups if g.kind == "perm" and g.size == L["mlp"]]
    wide = resize(a, {mlp[0]: 56}).model
    res = symgraph.compare(a, wide, null=1)
    assert res.max_rel_distance < 1e-5 and res.verdict == "derived" and len(res.null) == 1
    assert res.widths["model.layers.0.mlp.gate_proj.weight"] == ((48, 32), (56, 32))


def _run(capsys, *args):
    rc = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_command_compares_checkpoints_of_other_widths(dirs, capsys):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "pruned", "--null", "2", "--json")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["verdict"] == "derived" and rec["excess"] >= rec["threshold"] and rec["p_value"] < rec["alpha"]
    assert rec["mode"] == "in memory" and len(rec["widths"]) == 3
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "other", "--null", "2", "--json")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["verdict"] == "unrelated" and rec["excess"] < rec["threshold"]
    assert rec["widths"]["model.layers.0.mlp.gate_proj.weight"] == [[48, 32], [40, 32]]


def test_out_of_core_across_widths_gives_the_in_memory_numbers(dirs):
    """The merge engine aligns different widths out of core (weights): the same verdict, null
    and per-tensor numbers as in memory."""
    from symgraph.cli.compare import compare_paths
    mem = compare_paths(str(dirs / "a"), str(dirs / "pruned"), null=1, out_of_core=False)
    ooc = compare_paths(str(dirs / "a"), str(dirs / "pruned"), null=1, out_of_core=True)
    assert (mem.mode, ooc.mode) == ("in memory", "out of core")
    assert mem.verdict == ooc.verdict == "derived" and ooc.widths == mem.widths
    assert ooc.statistic == pytest.approx(mem.statistic, abs=1e-9)
    assert ooc.null == pytest.approx(mem.null, abs=1e-9)
    for x, y in zip(ooc.tensors, mem.tensors):
        assert x["name"] == y["name"] and x["correlation"] == pytest.approx(y["correlation"], abs=1e-7)


@pytest.mark.parametrize("flags", [(), ("--out-of-core",)])
def test_an_unmappable_dimension_is_refused_in_one_line(dirs, capsys, flags):
    rc, out, err = _run(capsys, "compare", dirs / "a", dirs / "vocab", *flags)
    assert rc == 2 and out == ""
    lines = err.rstrip("\n").splitlines()  # one refusal, wrapped as one paragraph
    assert lines[0].startswith("symgraph: ") and all(ln.startswith("  ") for ln in lines[1:]), err
    text = " ".join(err.split())
    assert "Traceback" not in err and "'model.embed_tokens.weight'" in text and "(64, 32) vs (48, 32)" in text
    assert "expected" in text


def test_python_refuses_an_unmappable_dimension_naming_the_tensor():
    a = models.build("llama", seed=0, **L)
    with pytest.raises(symgraph.InputError, match=r"differ in tensor 'model.embed_tokens.weight'.*expected"):
        symgraph.compare(a, models.build("llama", seed=1, **{**L, "vocab": 48}))
    with pytest.raises(symgraph.InputError, match="expected two models of one architecture"):
        symgraph.compare(a, models.build("llama", seed=1, **{**L, "layers": 2}))

"""Learned matching: align(..., refine=N) lowers the interpolated loss and stays a symmetry."""
import pytest
import torch

import symgraph
from conftest import cli, successor_sampler
from symgraph.core.elements import Perm
from symgraph.errors import InputError
from symgraph.testing.models import build, train

V = 64


@pytest.fixture(scope="module")
def pair():
    a, b = build("llama", seed=1), build("llama", seed=2)
    train(a, successor_sampler(1), steps=150, lr=3e-3, threads=1)
    train(b, successor_sampler(2), steps=150, lr=3e-3, threads=1)
    s = successor_sampler(99)
    return a, b, [s() for _ in range(4)]


def _mid_loss(a, b2, data):
    out = symgraph.interpolate(a, b2, [0.5], loss_fn=lambda m: sum(
        float(m(**x).loss) for x in data) / len(data))
    return out[0][1]


@pytest.mark.slow  # ~25-40 s; the default suite's budget is 10 minutes
def test_refine_lowers_the_interpolated_loss_and_keeps_b(pair):
    a, b, data = pair
    base = symgraph.align(a, b, data=data)
    before = _mid_loss(a, base.apply(b), data)
    al = symgraph.align(a, b, data=data, refine=40, refine_lr=1e-2)
    info = al.refined
    assert info["steps"] == 40 and info["classes"] >= 5
    assert info["loss_last"] < info["loss_first"] - 1e-3
    b2 = al.apply(b)
    after = _mid_loss(a, b2, data)
    assert after < before - 1e-3, (before, after)
    # still an exact symmetry of B: permutations stay permutations, rotations orthogonal
    for g in al.report_a.groups:
        E = al.elements.get(g.id)
        if isinstance(E, torch.Tensor) and g.kind in ("orthogonal", "orthogonal_mean"):
            eye = torch.eye(E.shape[-1], dtype=E.dtype)
            assert torch.allclose(E @ E.mT, eye.expand_as(E), atol=1e-10)
        if g.kind == "perm" and not g.outer:
            assert isinstance(E, Perm)
    x = data[0]
    with torch.no_grad():
        assert torch.allclose(b2(**x).logits, b(**x).logits, atol=1e-4)
    # the models passed in are untouched (refine works on copies of the values)
    assert al.to_dict()["refined"]["steps"] == 40


@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_refine_starts_from_the_alignment_with_the_lower_midpoint_loss(pair):
    from symgraph.alignment.refine import choose_start
    a, b, data = pair
    starts = {"activations": symgraph.align(a, b, data=data), "weights": symgraph.align(a, b),
              "unaligned": symgraph.align(a, b, groups=lambda g: False)}
    name, losses = choose_start(starts, a, b, data)
    expected = {k: _mid_loss(a, al.apply(b), data) for k, al in starts.items()}
    assert losses == pytest.approx(expected, abs=1e-5)
    assert name == min(expected, key=expected.get)
    assert losses["unaligned"] > max(losses["activations"], losses["weights"]) + 0.05
    # align(refine=N) starts from the better of activations and weights, and says so
    al = symgraph.align(a, b, data=data, refine=3)
    got = al.refined
    best = min(("activations", "weights"), key=losses.get)
    assert got["start"] == best and al.similarity == best
    assert got["start_loss"] == pytest.approx({k: losses[k] for k in ("activations", "weights")}, abs=1e-5)


@pytest.mark.slow  # the default suite took 747 s at 29a92d8 (budget 600 s); test_refine_lowers_the_interpolated_loss_and_keeps_b keeps refine in the default run
def test_refine_with_a_custom_loss(pair):
    a, b, data = pair
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["input_ids"][:, 1:].reshape(-1))
    al = symgraph.align(a, b, data=data, refine=5, loss_fn=loss_fn)
    # 5 steps, and each of the two starts (activations, weights) scored on every batch
    assert len(calls) == 5 + 2 * len(data) and al.refined["steps"] == 5


def test_refine_refuses_bad_input(pair):
    a, b, data = pair
    with pytest.raises(InputError, match="needs data"):
        symgraph.align(a, b, refine=3)
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="refine="):
            symgraph.align(a, b, data=data, refine=bad)
    with pytest.raises(InputError, match="loss_fn"):
        symgraph.align(a, b, data=data, refine=2, loss_fn="ce")
    x = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    y = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(InputError, match="refine needs a loss"):
        symgraph.align(x, y, data=[(torch.randn(16, 4),)], refine=2)


# --- the command line ------------------------------------------------------------------------
@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_cli_refine_and_no_fold_norms(tmp_path, pair):
    import json

    from safetensors.torch import save_file
    a, b, data = pair
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    save_file({"input_ids": torch.cat([x["input_ids"] for x in data])}, str(tmp_path / "d.safetensors"))
    out = tmp_path / "m"
    r = cli("merge", tmp_path / "a", tmp_path / "b", "--out", out, "--refine", "4",
             "--data", tmp_path / "d.safetensors")
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "symgraph_merge.json").read_text())
    assert meta["options"]["refine"] == 4 and meta["options"]["align"] == "activations"
    info = meta["alignments"][0]["refined"]
    assert info["steps"] == 4 and info["loss_last"] > 0
    r = cli("merge", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "p", "--no-fold-norms")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p" / "symgraph_merge.json").read_text())["options"]["fold_norms"] is False
    for args, msg in ((["--refine", "3"], "--refine needs --data"),
                      (["--refine", "-2", "--data", tmp_path / "d.safetensors"], "expected a number of steps"),
                      (["--refine", "2", "--align", "none", "--data", tmp_path / "d.safetensors"],
                       "--refine starts from activation matching, and --align says none; expected --align "
                       "activations")):
        r = cli("merge", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "x", *args)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
        assert not (tmp_path / "x").exists()
    y = tmp_path / "c.yaml"
    y.write_text(f"models: [{tmp_path / 'a'}, {tmp_path / 'b'}]\nout: {tmp_path / 'y'}\nrefine: lots\n")
    r = cli("merge", "--config", y)
    assert r.returncode == 2 and "'refine'" in r.stderr


@pytest.mark.slow
def test_cli_usage_errors_are_one_line(tmp_path):
    for args in (["merge", "a", "b", "--out", tmp_path / "x", "--refine", "abc"], ["bogus"], []):
        r = cli(*args)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
        assert "usage:" not in r.stderr and "Traceback" not in r.stderr
    assert "invalid int value: 'abc'" in cli("merge", "a", "b", "--refine", "abc").stderr

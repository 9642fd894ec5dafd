"""Checkpoints stored as the Hub stores them (transformers converts their names and layouts on
load: Mixtral's ``block_sparse_moe.experts.0.w1.weight`` one matrix per expert, where the model
stacks them into ``mlp.experts.gate_up_proj``) are read and written out of core through
transformers' own conversions, and the output is stored as the input was."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import symgraph
from symgraph.checkpoints.sharded import Checkpoint, KeysDiffer
from symgraph.testing.models import build


def _stored(path) -> dict:
    """``{key: (shape, dtype name, shard file)}`` of a checkpoint directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = (json.load(open(index))["weight_map"] if os.path.exists(index) else None)
    out = {}
    for f in sorted(set(files.values())) if files else ["model.safetensors"]:
        with safe_open(os.path.join(path, f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype(), f)
    return out


def _cli(*args):
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "symgraph", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two float32 Mixtral checkpoints, sharded, in the names save_pretrained writes
    (per-expert ``w1``, ``w2``, ``w3``), and the models they hold."""
    d = tmp_path_factory.mktemp("hub")
    models = [build("mixtral", s) for s in (0, 1)]
    for m, name in zip(models, "ab"):
        m.save_pretrained(d / name, max_shard_size="20KB")
    return str(d / "a"), str(d / "b"), models


def test_every_tensor_reads_as_from_pretrained_builds_it(pair):
    a, _, (model, _) = pair
    stored = _stored(a)
    assert any(".experts.0.w1.weight" in k for k in stored) and len({f for *_, f in stored.values()}) > 1
    ck = Checkpoint(a)
    assert ck.conversion is not None
    loaded = AutoModelForCausalLM.from_pretrained(a).state_dict()
    assert sorted(ck.keys) == sorted(k for k in loaded if k in model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in ck.keys
    for k in ck.keys:
        assert ck.shapes[k] == tuple(loaded[k].shape) and torch.equal(ck.get(k), loaded[k]), k
    rows = ck.get("model.layers.1.mlp.experts.down_proj", part=(0, 1, 3))
    assert torch.equal(rows, loaded["model.layers.1.mlp.experts.down_proj"][1:3])


def test_merge_out_of_core_equals_the_in_memory_merge_and_is_stored_as_the_input(pair, tmp_path):
    a, b, models = pair
    out = tmp_path / "merged"
    r = _cli("merge", a, b, "--out", str(out), "--memory-budget", "300KB", "--max-shard-size", "20KB")
    assert r.returncode == 0, r.stderr
    assert "loaded in memory" not in r.stderr
    assert json.load(open(out / "symgraph_merge.json"))["mode"] == "streaming"
    # names, shapes and dtypes as the input's, in shards of at most 20 KB
    assert {k: v[:2] for k, v in _stored(str(out)).items()} == {k: v[:2] for k, v in _stored(a).items()}
    assert len({f for *_, f in _stored(str(out)).values()}) > 1
    want = symgraph.merge(list(models)).model.state_dict()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)


def test_align_and_rotate_write_the_inputs_own_form_and_keep_the_function(pair, tmp_path):
    a, b, (A, B) = pair
    x = torch.randint(0, 64, (2, 10))
    for args, src, ref in ((["align", a, b], b, B), (["rotate", a], a, A)):
        out = tmp_path / args[0]
        r = _cli(*args, "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert _stored(str(out)) == _stored(src)  # names, shapes, dtypes and shards: the input's
        m = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            torch.testing.assert_close(m(x).logits, ref(x).logits, rtol=0, atol=1e-5)
        changed = m.model.layers[0].mlp.experts.gate_up_proj
        assert not torch.allclose(changed, ref.model.layers[0].mlp.experts.gate_up_proj), args[0]


def test_a_tensor_no_conversion_uses_is_still_refused(pair, tmp_path):
    a, _, _ = pair
    bad = tmp_path / "bad"
    AutoModelForCausalLM.from_pretrained(a).save_pretrained(bad)
    tensors = {}
    with safe_open(str(bad / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    save_file(tensors | {"extra.weight": torch.zeros(2)}, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeysDiffer, match="extra.weight"):
        Checkpoint(str(bad))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # transformers' own conversion fails on it (gate and up of unequal counts): refused saying so
    with pytest.raises(symgraph.InputError, match=r"gate_up_proj cannot be built .*3 stored as '\.experts\.\*\.w3"):
        Checkpoint(str(bad))


def test_a_weight_read_through_a_cast_folds_the_norm_in_every_dtype():
    """GLM-4 MoE's router computes ``linear(x.float(), weight.float())``: in float32 the casts
    are no-op checks, in bfloat16 copies. Either way the norm before the router folds into it,
    so the residual stream is a rotation, in every dtype (it stayed a permutation)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    cfg = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(cfg).eval()
    reports = [symgraph.analyze(model.to(dt)) for dt in (torch.float32, torch.bfloat16)]
    for rep in reports:
        assert rep.groups[0].kind == "orthogonal" and len(rep.folds) == 5
        assert any(r[0].endswith("mlp.gate.weight") for f in rep.folds for r in f.readers)
    assert [(g.kind, g.size) for g in reports[0].groups] == [(g.kind, g.size) for g in reports[1].groups]
    assert reports[0].certify(model.to(torch.float32)) < 1e-12


def test_experts_stored_in_two_dtypes_go_out_each_in_its_own(pair, tmp_path):
    """One expert's matrices in bfloat16, the rest float32: the model's stacked tensor holds them
    in float32 (exactly) and each goes back in the dtype it came in, out of core (it was loaded
    in memory and written all float32 before)."""
    import shutil
    a, b, _ = pair
    for src, name in ((a, "a"), (b, "b"), (a, "a_copy")):
        d = tmp_path / name
        shutil.copytree(src, d)
        for f in {f for *_, f in _stored(src).values()}:
            with safe_open(os.path.join(src, f), "pt") as h:
                save_file({k: h.get_tensor(k).bfloat16() if ".experts.1." in k else h.get_tensor(k)
                           for k in h.keys()}, str(d / f), metadata={"format": "pt"})
    a2, b2 = str(tmp_path / "a"), str(tmp_path / "b")
    stored = _stored(a2)
    assert {v[1] for k, v in stored.items() if ".experts.1." in k} == {"BF16"}
    out = tmp_path / "merged"
    r = _cli("merge", a2, b2, "--out", str(out), "--memory-budget", "300KB")
    assert r.returncode == 0 and "loaded in memory" not in r.stderr, r.stderr
    assert {k: v[:2] for k, v in _stored(str(out)).items()} == {k: v[:2] for k, v in stored.items()}
    aligned = tmp_path / "aligned"
    r = _cli("align", a2, str(tmp_path / "a_copy"), "--out", str(aligned))  # A beside its copy: A back
    assert r.returncode == 0, r.stderr
    assert _stored(str(aligned)) == stored
    for f in {f for *_, f in stored.values()}:
        with safe_open(str(aligned / f), "pt") as h, safe_open(os.path.join(a2, f), "pt") as g:
            for k in g.keys():
                torch.testing.assert_close(h.get_tensor(k).double(), g.get_tensor(k).double(), rtol=0,
                                           atol=1e-6)


def test_a_missing_expert_is_refused_naming_the_tensor_on_every_command(pair, tmp_path):
    """One expert's matrix deleted: every command refuses in one line naming the tensor it
    cannot build (merge and compare load through from_pretrained, whose own refusal pointed at
    a report its silenced logger never printed)."""
    import shutil
    a, _, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    index = json.load(open(bad / "model.safetensors.index.json"))
    gone = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    f = index["weight_map"].pop(gone)
    with safe_open(str(bad / f), "pt") as h:
        kept = {k: h.get_tensor(k) for k in h.keys() if k != gone}
    save_file(kept, str(bad / f), metadata={"format": "pt"})
    json.dump(index, open(bad / "model.safetensors.index.json", "w"))
    for args in (["merge", str(bad), a, "--out", str(tmp_path / "o")], ["compare", str(bad), a],
                 ["align", a, str(bad), "--out", str(tmp_path / "o")], ["rotate", str(bad), "--out", str(tmp_path / "o")]):
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.count("symgraph:") == 1 and "Traceback" not in r.stderr, r.stderr
        assert "down_proj" in r.stderr or "experts.3.w2" in r.stderr, (args[0], r.stderr)
        assert "above report" not in r.stderr and not (tmp_path / "o").exists()


def _rewritten(a, dest, change):
    """A copy of checkpoint ``a`` at ``dest`` with ``change(tensors of a shard, index)`` applied
    to the shard holding layer 0's expert 2 ``w1``."""
    import shutil
    shutil.copytree(a, dest)
    index = json.load(open(dest / "model.safetensors.index.json"))
    f = index["weight_map"]["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    with safe_open(str(dest / f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    change(tensors, index["weight_map"], f)
    save_file(tensors, str(dest / f), metadata={"format": "pt"})
    json.dump(index, open(dest / "model.safetensors.index.json", "w"))
    return str(dest)


def test_experts_transformers_cannot_stack_are_refused_naming_the_odd_tensor(pair, tmp_path):
    """An expert matrix of another shape, or an expert more for one matrix than for another:
    transformers' own conversion fails (its refusal points at a report its silenced logger
    never printed); every command refuses in one line saying which stored tensors differ and
    how, before any output exists."""
    a, _, _ = pair
    w1 = "model.layers.0.block_sparse_moe.experts.2.w1.weight"

    def shorter(t, index, f):
        t[w1] = t[w1][:-1].clone()

    def extra(t, index, f):
        t[w1.replace("experts.2", "experts.7")] = t[w1].clone()
        index[w1.replace("experts.2", "experts.7")] = f

    cases = {"shape": (_rewritten(a, tmp_path / "shape", shorter), f"{w1!r} is [23, 32] where the other 7 are [24, 32]"),
             "extra": (_rewritten(a, tmp_path / "extra", extra), "5 stored as '.experts.*.w1.weight', 4 stored as")}
    for bad, says in cases.values():
        for args in (["merge", a, bad, "--out", str(tmp_path / "o")], ["merge", bad, a, "--out", str(tmp_path / "o")],
                     ["compare", a, bad], ["analyze", bad], ["rotate", bad, "--out", str(tmp_path / "o")]):
            r = _cli(*args)
            err = " ".join(r.stderr.split())
            assert r.returncode == 2 and r.stderr.count("symgraph:") == 1 and "Traceback" not in r.stderr, r.stderr
            assert "model.layers.0.mlp.experts.gate_up_proj cannot be built" in err and says in err, (args, err)
            assert "above report" not in err and not (tmp_path / "o").exists()

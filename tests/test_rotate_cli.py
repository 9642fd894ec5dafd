"""``symgraph rotate MODEL --out DIR`` (issue 64): out of core, tensor by tensor, the same
tensors as :func:`symgraph.rotate` in memory; row slices within a small memory budget; bad
input refused with exit 2 and one line."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import symgraph
from symgraph.cli.main import main
from symgraph.testing import models

transformers = pytest.importorskip("transformers")

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("rot")
    for name, arch, kw in (("llama", "llama", L), ("gpt2", "gpt2", {})):
        m = models.randomize_vectors(models.build(arch, seed=0, **kw), seed=1)
        m.save_pretrained(root / name)
    torch.manual_seed(0)  # Gemma: norm gains read as 1 + w, and a tied head
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, intermediate_size=48, max_position_embeddings=64, use_cache=False))
    models.randomize_vectors(gemma, seed=1).save_pretrained(root / "gemma")
    return root


def stored(directory):
    out = {}
    for fn in os.listdir(directory):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, fn)))
    return out


def run(argv, capsys):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # a usage error: argparse exits 2 with one line
        code = e.code
    return code, capsys.readouterr()


def one_line_refusal(code, cap, *needles):
    assert code == 2
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) >= 1 and lines[0].startswith("symgraph") and "Traceback" not in cap.err
    assert sum(ln.startswith("symgraph") for ln in lines) == 1, cap.err
    text = " ".join(cap.err.split())
    for n in needles:
        assert n in text, (n, text)


@pytest.mark.parametrize("name,budget", [("llama", None), ("llama", "70KB"), ("gpt2", None), ("gpt2", "36KB"),
                                         ("gemma", None)])
@pytest.mark.slow
def test_cli_equals_in_memory(ws, capsys, name, budget):
    out = ws / f"out_{name}_{budget}"
    before = {k: v.clone() for k, v in stored(ws / name).items()}
    argv = ["rotate", ws / name, "--out", out, "--how", "hadamard", "--seed", "5"]
    code, cap = run(argv + (["--memory-budget", budget] if budget else []), capsys)
    assert code == 0, cap.err
    assert {k: torch.equal(v, before[k]) for k, v in stored(ws / name).items()} == {k: True for k in before}
    model = transformers.AutoModelForCausalLM.from_pretrained(ws / name, trust_remote_code=False).eval()
    res = symgraph.rotate(model, how="hadamard", seed=5)
    want = {k: v for k, v in res.model.state_dict().items()}
    got = stored(out)
    for k, v in got.items():
        assert v.dtype == want[k].dtype, k
        assert torch.allclose(v, want[k], rtol=1e-6, atol=1e-7), (k, float((v - want[k]).abs().max()))
    record = json.load(open(out / "symgraph_rotate.json"))["symgraph_rotate"]
    if budget:
        limit = int(budget.removesuffix("KB")) * 1000
        assert 0 < record["bytes_held"] <= limit
    back = type(model).from_pretrained(out, trust_remote_code=False).eval()
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=x).logits.double(), back(input_ids=x).logits.double()
    assert float((a - b).norm() / a.norm()) <= 1e-5
    if name in ("gpt2", "gemma"):  # tied head untied: the stream rotates
        assert record["untied"] and json.load(open(out / "config.json"))["tie_word_embeddings"] is False
        assert "lm_head.weight" in got


@pytest.mark.parametrize("case", ["missing", "out_inside", "learned", "budget_too_small", "budget_garbage",
                                  "classes"])
def test_cli_refuses_bad_input(ws, capsys, case):
    m, out = ws / "llama", ws / f"refused_{case}"
    argv = {
        "missing": (["rotate", ws / "nowhere", "--out", out], ["nowhere"]),
        "out_inside": (["rotate", m, "--out", m / "rotated"], ["inside the input directory"]),
        "learned": (["rotate", m, "--out", out, "--how", "learned"], ["--how", "invalid choice"]),
        "budget_too_small": (["rotate", m, "--out", out, "--memory-budget", "2KB"], ["--memory-budget", "expected at least"]),
        "budget_garbage": (["rotate", m, "--out", out, "--memory-budget", "lots"], ["'lots'", "expected a positive size"]),
        "classes": (["rotate", m, "--out", out, "--classes", "mlp"], ["--classes", "invalid choice"]),
    }[case]
    code, cap = run(argv[0], capsys)
    one_line_refusal(code, cap, *argv[1])
    assert not out.exists() and not (m / "rotated").exists()


def test_cli_keeps_shards_and_a_tied_head(ws, capsys):
    """A sharded input is written with its shard layout; --keep-tied keeps GPT-2's head tied (its
    stream then keeps its basis: only the value-output maps rotate)."""
    m = transformers.AutoModelForCausalLM.from_pretrained(ws / "gpt2", trust_remote_code=False)
    m.save_pretrained(ws / "gpt2_sharded", max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(ws / "gpt2_sharded") if f.endswith(".safetensors"))
    assert len(shards) > 1
    out = ws / "out_sharded"
    code, cap = run(["rotate", ws / "gpt2_sharded", "--out", out, "--keep-tied"], capsys)
    assert code == 0, cap.err
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    record = json.load(open(out / "symgraph_rotate.json"))["symgraph_rotate"]
    assert not record["untied"] and record["classes"]["stream"] == [] and record["classes"]["vo"]
    assert json.load(open(out / "config.json")).get("tie_word_embeddings", True) is not False
    back = type(m).from_pretrained(out, trust_remote_code=False).eval()
    assert back.lm_head.weight is back.transformer.wte.weight
    want = symgraph.rotate(m, untie=False).model.state_dict()
    got = stored(out)
    assert all(torch.allclose(v, want[k], rtol=1e-6, atol=1e-7) for k, v in got.items())
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = m(input_ids=x).logits.double(), back(input_ids=x).logits.double()
    assert float((a - b).norm() / a.norm()) <= 1e-5

"""Circuit-space heads (``--attention circuits``) out of core: the merge engine widens every
head as it combines, writes the wider shapes and the config that states them, and its
checkpoint equals the in-memory circuit merge (tensors, config, logits) within its memory
budget; what the in-memory path refuses, the engine refuses."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import symgraph
from symgraph.cli.main import main as cli
from symgraph.errors import InputError
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.merging.streaming import StreamingMerge
from symgraph.testing import models

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("circuits")
    for i in range(2):
        models.build("llama", seed=i, **SIZES).save_pretrained(str(d / f"m{i}"))
    return d


def _load(path):
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def _rel(a, b):
    assert a.keys() == b.keys()
    assert {k: a[k].shape for k in a} == {k: b[k].shape for k in b}
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in a)


def _in_memory(pair, out, anchor=0, **options):
    cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(out), attention="circuits", **options)
    return run_merge(cfg, streaming=False, progress=False, anchor=anchor)


def _logits(path, x):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return m, m(x).logits.double()


def test_circuits_run_out_of_core_and_equal_the_in_memory_merge(pair, tmp_path, capsys):
    out = tmp_path / "stream"
    rc = cli(["merge", str(pair / "m0"), str(pair / "m1"), "--attention", "circuits", "--out", str(out),
              "--memory-budget", "128KB"])
    assert rc == 0
    said = capsys.readouterr()
    assert "loaded in memory" not in said.err and "circuit-space heads, out of core" in said.out
    assert _in_memory(pair, tmp_path / "mem").mode == "in-memory"
    streamed, loaded = _load(out), _load(tmp_path / "mem")
    assert _rel(streamed, loaded) < 1e-5
    assert streamed["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 2 * 8, 32)  # 2 KV heads, 2x8 wide
    x = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(0))
    ms, got = _logits(out, x)
    mm, want = _logits(tmp_path / "mem", x)
    assert ms.config.head_dim == 16 and ms.config.rope_parameters["rope_type"] == "longrope"
    drop = {"_name_or_path"}
    assert ({k: v for k, v in ms.config.to_dict().items() if k not in drop}
            == {k: v for k, v in mm.config.to_dict().items() if k not in drop})
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    records = [json.load(open(p / "symgraph_merge.json")) for p in (out, tmp_path / "mem")]
    assert records[0]["mode"] == "streaming" and records[0]["architecture"] == records[1]["architecture"]
    assert "16 wide instead of 8" in records[0]["architecture"][0]


@pytest.mark.slow  # the aligned merge with anchor 0 runs by default, here and in tests/test_engine.py
@pytest.mark.parametrize("options", [dict(align="none"), dict(anchor=1, weights=[0.3, 0.7])])
def test_unaligned_and_other_anchor_equal_in_memory(pair, tmp_path, options):
    """Without alignment (the anchor analysed for the plan alone) and with the second model
    as anchor and unequal weights (the anchor first in the widened heads, as in memory)."""
    cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], out=str(tmp_path / "stream"),
                      attention="circuits", **{k: v for k, v in options.items() if k != "anchor"})
    assert run_merge(cfg, streaming=True, progress=False, anchor=options.get("anchor", 0)).mode == "streaming"
    _in_memory(pair, tmp_path / "mem", **options)
    assert _rel(_load(tmp_path / "stream"), _load(tmp_path / "mem")) < 1e-5


def test_the_circuit_merge_holds_no_more_than_its_budget(pair, tmp_path):
    budget = 128 << 10
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], attention="circuits", memory_budget=budget)
    job.align()
    job.write(str(tmp_path))
    assert 0 < job.resources.ledger.peak <= budget
    assert job.resources.ledger.now == 0  # everything it held was let go
    assert json.load(open(tmp_path / "config.json"))["head_dim"] == 16


def test_what_memory_refuses_the_engine_refuses(pair, tmp_path):
    paths = [str(pair / "m0"), str(pair / "m1")]
    with pytest.raises(InputError, match="attention 'wide'; expected one of 'heads', 'circuits'"):
        StreamingMerge(paths, attention="wide")  # the config's own refusal, as on the command line
    data = [{"input_ids": torch.randint(0, 64, (4, 8))}]
    for kw in ({"method": "fisher"}, {"repair": True}):  # the config's rule, one line for both
        with pytest.raises(InputError, match="attention circuits merges by averaging; expected method average "
                           "without repair"):
            StreamingMerge(paths, attention="circuits", data=data, **kw)
    for i in range(2):
        models.build("gpt2", seed=i, vocab=64, hidden=32, layers=2, heads=4, positions=64).save_pretrained(
            str(tmp_path / f"g{i}"))
    with pytest.raises(InputError, match="no head_dim field"):
        StreamingMerge([str(tmp_path / "g0"), str(tmp_path / "g1")], attention="circuits")


def test_circuit_heads_widen_the_plan_from_what_they_are_given(pair, tmp_path):
    """The transform reads only its arguments (the config, the checkpoints, the method's name, the
    anchor's report), never an engine: its widening is the wider shapes of every head tensor,
    the config fields that state them, and a combine equal to :func:`circuit_state`."""
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.merging.circuits import CircuitHeads, circuit_state
    ckpts = [Checkpoint(str(pair / f"m{i}")) for i in range(2)]
    cfg = MergeConfig(models=[str(pair / "m0"), str(pair / "m1")], attention="circuits", anchor=1)
    report = symgraph.analyze(ckpts[1].model)  # on meta, as the engine's Analyze step does
    heads = CircuitHeads(cfg, ckpts, "average", lambda: report)
    wide = heads.widening()
    layer = "model.layers.0.self_attn."
    assert wide.out_shapes[layer + "q_proj.weight"] == (4 * 16, 32)  # 4 heads of 2 x 8
    assert wide.out_shapes[layer + "k_proj.weight"] == (2 * 16, 32)  # 2 KV heads
    assert wide.out_shapes[layer + "o_proj.weight"] == (32, 64)
    assert not any("mlp" in k or "norm" in k for k in wide.out_shapes)  # only the heads widen
    assert wide.config_updates["head_dim"] == 16 and wide.config_updates["rope_parameters"]["rope_type"] == "longrope"
    names = [layer + p for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")]
    values = [{n: c.get(n) for n in names} for c in ckpts]
    got = wide.combine(names, values, [None, None], [0.3, 0.7], None)
    want = circuit_state([values[1], values[0]], [0.7, 0.3], heads.built()[0])  # the anchor (1) first
    assert all(torch.equal(got[n], want[n]) for n in names) and got[names[0]].shape == (64, 32)
    with pytest.raises(InputError, match="not method='mine'; expected method='average'"):
        CircuitHeads(cfg, ckpts, "mine", lambda: None)


def test_a_config_that_cannot_hold_the_wider_heads_is_refused_naming_the_tensor():
    from symgraph.merging.circuits import plan, wide_shapes
    from symgraph.width.heads import wide_config
    m = models.build("llama", seed=0, **SIZES)
    cplan = plan(symgraph.analyze(m))
    cfg = wide_config(m, cplan.head_dim, 2, cplan.rope)
    old = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = dict(old)  # a model class that ignored the new head size
    with pytest.raises(InputError, match="builds model.layers.0.self_attn.q_proj.weight as \\(32, 32\\), not "
                       "\\(64, 32\\); the config cannot express the wider heads"):
        wide_shapes(cplan, cfg, old, want, 2)
    with pytest.raises(InputError, match="disagree on tensor 'extra'"):
        wide_shapes(cplan, cfg, old, {**want, "extra": (1,)}, 2)


def test_the_circuit_line_is_the_engines_circuit_merge():
    """``circuit_merge`` (the barrier's circuit-space line, learned matching's ``between``) of
    models whose config states wider heads is the merge engine's: the tensors of
    ``symgraph.merge(..., attention="circuits")`` bit for bit, and the circuit-space function
    of the interpolation (``Σ w_i`` of each head's forms) at the ends."""
    from symgraph.merging.driver import circuit_merge
    A, B = (models.build("llama", seed=i, **SIZES) for i in range(2))
    Bal = symgraph.align(A, B).apply(B)
    rep = symgraph.analyze(A)
    for w in ([0.3, 0.7], [1.0, 0.0]):
        line = circuit_merge([A, Bal], w, rep)
        merged = symgraph.merge([A, Bal], weights=w, align=None, attention="circuits").model
        assert type(line) is type(merged) and line.config.head_dim == 2 * A.config.head_dim
        a, b = line.state_dict(), merged.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(line(x).logits, A(x).logits, atol=1e-5, rtol=0)  # weight 1 on A: A's function


def test_a_config_whose_head_dim_is_none_states_the_wider_heads(tmp_path, capsys):
    """Mixtral's config holds ``head_dim: None`` (its attention takes width over heads): the
    circuit merge states the wider heads there too, out of core equal to the in-memory merge,
    and a head size the config does not state is refused in one line saying what it expects."""
    from transformers import AutoModelForCausalLM
    from symgraph.width.heads import wide_config
    for i in range(2):
        models.build("mixtral", seed=i).save_pretrained(str(tmp_path / f"x{i}"))
    a, b = (AutoModelForCausalLM.from_pretrained(str(tmp_path / f"x{i}")).eval() for i in range(2))
    assert "head_dim" in a.config.to_dict() and a.config.head_dim is None
    out = tmp_path / "stream"
    rc = cli(["merge", str(tmp_path / "x0"), str(tmp_path / "x1"), "--attention", "circuits", "--out", str(out),
              "--memory-budget", "256KB"])
    assert rc == 0, capsys.readouterr().err
    assert "circuit-space heads, out of core" in capsys.readouterr().out
    x = torch.randint(0, a.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    m, got = _logits(out, x)
    d = a.config.hidden_size // a.config.num_attention_heads
    assert m.config.head_dim == 2 * d
    with torch.no_grad():
        want = symgraph.merge([a, b], attention="circuits").model(x).logits.double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    with pytest.raises(InputError, match=f"states heads {d} wide but the report's are {d + 1} wide; expected"):
        wide_config(a, d + 1, 2, False)

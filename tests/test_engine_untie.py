"""``symgraph merge --untie`` out of core: each checkpoint is read as its untied model (a tied
head its own key, read from the embedding's stored tensor), aligned and merged by the engine,
and written with the head as its own tensor and ``tie_word_embeddings: false``; it equals the
in-memory untied merge and stays within its memory budget."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from symgraph.checkpoints.sharded import Checkpoint, parse_size
from symgraph.cli.main import main as cli
from symgraph.app.config import MergeConfig
from symgraph.app.run import run_merge
from symgraph.checkpoints.sharded import write_config
from symgraph.merging.streaming import StreamingMerge
from symgraph.core.ties import untie_config_updates
from symgraph.testing import models

from engine_helpers import load, rel

SIZES = dict(vocab=64, hidden=32, layers=2, heads=4, mlp=48, positions=64)
HEAD, EMBED = "lm_head.weight", "transformer.wte.weight"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny tied GPT-2s with random norm gains and biases: with HF's unit gains an untied
    head is moved exactly as the embedding (and stays equal to it); gains near 0 (as
    :func:`~symgraph.testing.models.randomize_vectors` can draw) make the solved rotations
    ill-conditioned, so the two paths' float32 rounding would part them by 1e-4."""
    d = tmp_path_factory.mktemp("gpt2")
    for i in range(2):
        m = models.build("gpt2", seed=i, **SIZES)
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.dim() == 1:  # gains in [0.8, 1.2], biases in [-0.2, 0.2]
                    p.copy_(float(n.endswith("weight")) + 0.2 * (2 * torch.rand(p.shape, generator=g) - 1))
        assert m.config.tie_word_embeddings
        m.save_pretrained(str(d / f"m{i}"))
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 64, (40, 12), generator=g)}, str(d / "data.safetensors"))
    return d


_load, _rel = load, rel


def test_a_checkpoint_read_untied_has_the_head_as_its_own_key(pair):
    c = Checkpoint(str(pair / "m0"))
    assert HEAD not in c.shapes and c.key(HEAD) == EMBED  # save_pretrained stored the tied group once
    u = c.untied()
    assert u.source is c and HEAD not in c.keys and HEAD not in c.shapes  # the stored one is untouched
    assert u.keys[-1] == HEAD and u.key(HEAD) == HEAD and u.key(EMBED) == EMBED
    assert u.shapes[HEAD] == c.shapes[EMBED] and u.dtypes[HEAD] == c.dtypes[EMBED]
    assert u.params[HEAD] == [HEAD] and u.params[EMBED] == [EMBED]
    assert not u.config.tie_word_embeddings and c.config.tie_word_embeddings
    assert u.model.lm_head.weight is not u.model.transformer.wte.weight
    assert torch.equal(u.get(HEAD), c.get(EMBED)) and torch.equal(u.fetch(HEAD), c.get(EMBED))
    assert torch.equal(u.read(HEAD, part=(0, 3, 7)), c.get(EMBED)[3:7])


@pytest.mark.parametrize("method", ["average", "fisher"])
def test_untie_runs_out_of_core_and_equals_in_memory(pair, tmp_path, method, capsys):
    """``--untie`` through the command runs in the engine (Fisher's statistics measured on the
    untied model, as in memory), and equals the in-memory untied merge."""
    from transformers import AutoModelForCausalLM
    models_ = [str(pair / "m0"), str(pair / "m1")]
    opts = ["--method", "fisher", "--align", "none", "--data", str(pair / "data.safetensors")] \
        if method == "fisher" else []
    out = tmp_path / "stream"
    assert cli(["merge", *models_, "--untie", "--out", str(out), "--memory-budget", "256KB", *opts]) == 0
    said = capsys.readouterr()
    assert "loaded in memory" not in said.err and "out of core" in said.out + said.err
    extra = dict(method="fisher", align="none", data=str(pair / "data.safetensors")) if method == "fisher" else {}
    mem = run_merge(MergeConfig(models=models_, out=str(tmp_path / "mem"), untie=True, **extra),
                    streaming=False, progress=False)
    assert mem.mode == "in-memory"
    streamed, loaded = _load(out), _load(tmp_path / "mem")
    assert HEAD in streamed and _rel(streamed, loaded) < 1e-5
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    records = [json.loads((p / "symgraph_merge.json").read_text()) for p in (out, tmp_path / "mem")]
    assert records[0]["mode"] == "streaming" and records[0]["architecture"] == records[1]["architecture"]
    assert "2048 more parameters" in records[0]["architecture"][0]  # 64 tokens x 32 wide
    m = AutoModelForCausalLM.from_pretrained(str(out))
    assert not m.config.tie_word_embeddings and m.lm_head.weight is not m.transformer.wte.weight
    assert torch.equal(m.lm_head.weight, streamed[HEAD]) and torch.equal(m.transformer.wte.weight, streamed[EMBED])
    assert not torch.allclose(m.lm_head.weight, m.transformer.wte.weight)


def test_the_untied_engine_holds_no_more_than_its_budget(pair, tmp_path):
    job = StreamingMerge([str(pair / "m0"), str(pair / "m1")], memory_budget="256KB", untie=True)
    assert job.transforms.config_updates == {"tie_word_embeddings": False}
    job.align()
    job.write(str(tmp_path))
    assert 0 < job.resources.ledger.peak <= parse_size("256KB")
    assert job.resources.ledger.now == 0  # everything it held was let go
    assert HEAD in _load(tmp_path)


def test_the_config_updates_reach_a_nested_text_config(tmp_path):
    """A multimodal config keeps its flag in ``text_config`` (and often at the top): both are
    turned off, the nested one merged into the nested config, not replacing it."""
    from transformers import Gemma3Config, LlavaConfig
    assert untie_config_updates(Gemma3Config()) == {"tie_word_embeddings": False,
                                                    "text_config": {"tie_word_embeddings": False}}
    assert untie_config_updates(LlavaConfig()) == {}  # nothing tied: nothing to change
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "in" / "config.json").write_text(json.dumps(
        {"tie_word_embeddings": True, "text_config": {"hidden_size": 8, "tie_word_embeddings": True}}))
    write_config(str(tmp_path / "in"), str(tmp_path / "out"), untie_config_updates(Gemma3Config()))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {"tie_word_embeddings": False, "text_config": {"hidden_size": 8, "tie_word_embeddings": False}}


def test_untie_with_nothing_tied_is_refused_on_every_path(tmp_path, capsys):
    """``--untie`` on models that tie nothing would change nothing while the summary said
    "untied": refused in one line, out of core, in memory and in Python, and nothing written."""
    import symgraph
    from symgraph.errors import InputError
    ms = [models.build("llama", seed=i, **SIZES) for i in range(2)]
    assert not any(m.config.tie_word_embeddings for m in ms)
    for i, m in enumerate(ms):
        m.save_pretrained(str(tmp_path / f"l{i}"))
    said = "no model ties parameters"
    for extra in ([], ["--memory-budget", "64KB"], ["--device", "cpu"]):
        capsys.readouterr()
        rc = cli(["merge", str(tmp_path / "l0"), str(tmp_path / "l1"), "--untie", "--out", str(tmp_path / "o"),
                  *extra])
        err = capsys.readouterr().err
        assert rc == 2 and said in err and "expected models with a tied head" in err, err
        assert err.count("symgraph:") == 1 and "Traceback" not in err and not (tmp_path / "o").exists()
    cfg = MergeConfig(models=[str(tmp_path / "l0"), str(tmp_path / "l1")], out=str(tmp_path / "o"), untie=True)
    with pytest.raises(InputError, match=said):
        run_merge(cfg, streaming=False, progress=False)
    with pytest.raises(InputError, match=said):
        symgraph.merge(ms, untie=True)

"""The anchor benchmark off the CPU (issue 43): a parent trained on a device that is not the CPU
(``fakegpu``, :mod:`symgraph.testing.device`: an op mixing its tensors with CPU tensors raises)
in float32, recording where and how; the table's ``--device`` path end to end on cached parents;
which rows a resumed run may keep; and the peer glue run by any interpreter with a PYTHONPATH."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.anchor import data, peer, report, table
from benchmarks.anchor import train as tr

from benchmarks.tests.test_anchor_data import TINY, TOKENIZER, needs_tokenizer, synthetic_text


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(synthetic_text(), encoding="utf-8")
    return p


def _train(corpus, cache, device, **kw):
    args = dict(config_overrides=TINY, block_size=16, batch_size=2, eval_every=2, max_steps=3,
                echo=lambda m: None, device=device, lr=1e-3)
    return tr.train(corpus, TOKENIZER, 3, cache=cache, **{**args, **kw})


@needs_tokenizer
def test_a_parent_trains_on_a_device_in_float32_and_says_so(corpus, tmp_path):
    """The same steps on the device as on the CPU (data order, dropout and initialisation do not
    depend on it); the log names the device, the precision and the versions; a cache whose
    parent was trained in another precision is refused, not reused."""
    from symgraph.testing.device import install
    dev = install()
    log = _train(corpus, tmp_path / "d", dev)
    ref = _train(corpus, tmp_path / "c", "cpu")
    assert (log["device"], log["precision"]) == ("fakegpu", "float32") and ref["device"] == "cpu"
    run = log["runs"][0]
    assert run["torch"] == torch.__version__ and run["float32_matmul_precision"] == "highest"
    assert log["protocol"]["bf16"] is False and run["start_step"] == 0
    ck = lambda c: torch.load(tr.checkpoint_path(c, 3), map_location="cpu", weights_only=False)
    got, want = ck(tmp_path / "d"), ck(tmp_path / "c")
    assert {type(v) for v in got["model"].values()} == {torch.Tensor}  # host copies: resumable anywhere
    torch.testing.assert_close(got["model"], want["model"], rtol=1e-5, atol=1e-6)
    assert got["rng_cuda"] is None and not torch.equal(got["model"]["lm_head.weight"], tr.load_parent(
        tmp_path / "d", 3).lm_head.weight.detach())  # trained after the best model (step 2) was saved
    assert log["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
    assert log["evals"][0]["val_loss"] == pytest.approx(ref["evals"][0]["val_loss"], rel=1e-5)
    # a finished float32 parent is not handed to a bf16 run
    done = tmp_path / "done"
    _train(corpus, done, "cpu", max_steps=None, epochs=1, eval_every=1000)
    assert tr.read_log(done, 3)["done"]
    with pytest.raises(data.AnchorError, match="trained in float32, not bf16"):
        _train(corpus, done, "cpu", max_steps=None, epochs=1, eval_every=1000, bf16=True)


def _cached_parents(cache: Path):
    from transformers import GPT2LMHeadModel
    for s in (0, 1):
        torch.manual_seed(s)
        m = GPT2LMHeadModel(data.config(block_size=64, **TINY))
        m.save_pretrained(cache / f"parent-seed{s}")
        (cache / f"parent-seed{s}" / "train_log.json").write_text(json.dumps(
            {"precision": "float32", "device": "cuda:0 (test)", "done": True, "train_loss": [1.0],
             "final_test_loss": 5.0, "protocol": {"bf16": False}}))


@needs_tokenizer
def test_the_table_runs_on_a_device(tmp_path, monkeypatch):
    """``--device fakegpu --no-train`` on cached parents: the rows are computed there (a tensor
    left on the CPU would raise) and equal the CPU's; results.json records the commit, the code,
    the device and each row's options; the report's header names device and precision; the
    parents' train logs are copied beside it; a row that fails is reported and the next one runs."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(synthetic_text(600), encoding="utf-8")
    _cached_parents(tmp_path / "cache" / "tiny")
    out = tmp_path / "out"
    args = ["--corpus", str(corpus), "--tokenizer", str(TOKENIZER), "--cache", str(tmp_path / "cache"), "--tiny",
            "--no-train", "--rows", "vanilla", "weights_seen", "--no-circuits", "--out", str(out)]
    real = table.run_row
    monkeypatch.setattr(table, "run_row", lambda name, *a, **k: 1 / 0 if name == "vanilla" else real(name, *a, **k))
    assert table.main(args + ["--device", "fakegpu"]) == 2  # a row failed ...
    res = json.loads((out / "results.json").read_text())
    assert res["errors"] == ["vanilla (heads): ZeroDivisionError: division by zero"]  # ... the next one ran
    assert res["device"] == "fakegpu" and res["env"]["precision"] == "float32"
    assert res["code_digest"] == report.code_digest() and "commit" in res and res["settings"]["eval_batch"] == 32
    (row,) = res["rows"]
    assert row["device"] == "fakegpu:0" and row["options"]["align"] == "weights"
    assert row["options"]["seen_rows"]["transformer.wte.weight"] > 0 and row["align_seconds"] > 0
    assert res["parents"][0]["precision"] == "float32" and res["parents"][0]["device"] == "cuda:0 (test)"
    md = (out / "report.md").read_text()
    assert "**Errors** (rows not measured): vanilla (heads): ZeroDivisionError" in md
    assert "Computed on **fakegpu** in **float32**" in md and "Parents trained in **float32 on cuda:0 (test)**" in md
    assert json.loads((out / "train_log_seed1.json").read_text())["device"] == "cuda:0 (test)"
    # the ends of the curve, computed on the device, are the parents' losses on the CPU (B aligned keeps its loss)
    splits = data.load_splits(corpus, TOKENIZER, tmp_path / "cache")
    test = data.sequences(splits["test"], 64)[:table.TINY_TEST]
    ends = dict(row["curve"])
    assert res["settings"]["lambdas"][-1] == 1.0 and row["options"]["test_sequences"] == len(test) >= 4
    for lam, s in ((1.0, 0), (0.0, 1)):
        want = data.test_loss(tr.load_parent(tmp_path / "cache" / "tiny", s), test)
        assert ends[lam] == pytest.approx(want, rel=1e-5) and res["parent_test_loss"][s] == pytest.approx(want, rel=1e-5)
    assert row["barrier"] > 0


def test_a_resumed_run_keeps_rows_of_the_same_commit_code_device_and_parents_only(tmp_path):
    base = {"commit": "abc", "dirty": False, "code_digest": "d1", "device": "cuda", "settings": {"s": 1},
            "parent_test_loss": [5.1, 5.2], "protocol_note": "x", "command": "c"}
    rows = [{"row": "weights", "space": "heads", "barrier": 0.5, "curve": [], "seconds": 1.0},
            {"row": "peer_weights", "space": "heads", "by": "peer", "barrier": 0.5, "curve": [], "seconds": 1.0,
             "align_seconds": 1.0, "peer": {"b_loss_rel_change": 0.0}}]
    report.write({**base, "rows": rows}, tmp_path)
    assert list(report.previous_rows(tmp_path, base)) == [("weights", "heads")]  # peer rows: always rerun
    for change in ({"commit": "abd"}, {"code_digest": "d2"}, {"device": "cpu"}, {"settings": {"s": 2}},
                   {"parent_test_loss": [5.1, 5.3]}, {"dirty": True}, {"commit": None}):
        assert report.previous_rows(tmp_path, {**base, **change}) == {}, change
    assert report.previous_rows(tmp_path / "none", base) == {}


def test_the_results_are_strict_json_without_machine_paths(tmp_path):
    """A row whose barrier is NaN is written null (strict JSON), and a path inside this checkout
    is written ``<repo>``: ``results.json`` goes through the benchmarks' one JSON writer."""
    import json
    from benchmarks.provenance import REPO_ROOT
    rows = [{"row": "weights", "space": "heads", "barrier": float("nan"), "curve": [], "seconds": 1.0,
             "note": str(REPO_ROOT / "x.txt")}]
    report.write({"commit": "abc", "parent_test_loss": [5.1, 5.2], "protocol_note": "", "command": "c",
                  "rows": rows}, tmp_path)
    text = (tmp_path / "results.json").read_text()
    row = json.loads(text)["rows"][0]  # json.loads accepts NaN: check the text too
    assert "NaN" not in text and row["barrier"] is None
    assert str(REPO_ROOT) not in text and row["note"] == "<repo>/x.txt"


def test_a_copy_of_their_source_without_git_is_known_by_its_digests(tmp_path, monkeypatch):
    import hashlib
    for f in ("merger.py", "weight_matching.py", "utils.py", "enums.py"):
        (tmp_path / f).write_text(f"# {f}\n")
    monkeypatch.setattr(peer, "PEER_SHA256", {f: hashlib.sha256(f"# {f}\n".encode()).hexdigest()[:16]
                                              for f in ("merger.py", "weight_matching.py", "utils.py", "enums.py")})
    assert peer.check_source(tmp_path) == peer.PEER_COMMIT
    (tmp_path / "utils.py").write_text("# changed\n")
    assert peer.check_source(tmp_path) is None


def test_the_glue_runs_with_a_given_interpreter_and_pythonpath(tmp_path, monkeypatch):
    """``--peer-python``/``--peer-pythonpath``: the glue's process gets exactly that PYTHONPATH
    (before the interpreter's own packages), its output comes back through files, and a run that
    imported another transformers than theirs is refused."""
    site = tmp_path / "site" / "transformers"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("__version__ = '4.50.1'\n")
    runner = tmp_path / "runner.py"
    runner.write_text("import json, os, sys, transformers\nprint('noise', file=sys.stderr)\n"
                      "print(json.dumps({'versions': {'transformers': transformers.__version__}, "
                      "'env_pythonpath': os.environ['PYTHONPATH'], 'spec': json.load(open(sys.argv[1]))['threads']}))\n")
    monkeypatch.setattr(peer, "RUNNER", runner)
    res = peer.run_glue(sys.executable, tmp_path, "a", "b", tmp_path / "o", threads=3, pythonpath=str(tmp_path / "site"))
    assert res["versions"]["transformers"] == "4.50.1" and res["spec"] == 3
    assert res["env_pythonpath"] == res["pythonpath"] == str(tmp_path / "site") and res["python"] == sys.executable
    (site / "__init__.py").write_text("__version__ = '5.0.0'\n")
    with pytest.raises(peer.PeerError, match="imported transformers 5.0.0, not their 4.50.1"):
        peer.run_glue(sys.executable, tmp_path, "a", "b", tmp_path / "o", pythonpath=str(tmp_path / "site"))
    runner.write_text("import sys\nsys.exit('their code failed here')\n")
    with pytest.raises(peer.PeerError, match="exited 1: their code failed here"):
        peer.run_glue(sys.executable, tmp_path, "a", "b", tmp_path / "o")

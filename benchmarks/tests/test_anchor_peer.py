"""The anchor benchmark's glue to Theus et al.'s released code (:mod:`benchmarks.anchor.peer`).

Slow: their weight matching (their code at 6b207cc, in their own venv) on two tiny GPT-2s: their
aligned B keeps B's loss (an alignment is a symmetry), differs from B, and our circuit-space
evaluation of the exported pair equals their merger's interpolation at λ = 0.5. Needs the peer's
source and venv under ``$SYMGRAPH_ANCHOR_PEER`` (default ``~/.cache/symgraph/anchor/peer``):
``python -m benchmarks.anchor.peer fetch`` then ``... venv``; skipped when either is absent (this
test never creates them). Fast: the barrier of theirs, the source check, the norm swap, the report."""
from __future__ import annotations

import pytest
import torch

from benchmarks.anchor import peer
from symgraph.testing.models import build, randomize_vectors


def test_barrier_theirs_is_above_the_chord():
    curve = [(0.0, 2.0), (0.5, 3.5), (1.0, 4.0)]  # B at λ=0 (2.0), A at λ=1 (4.0)
    assert peer.barrier_theirs(curve) == pytest.approx(0.5)
    assert peer.barrier_theirs([(1.0, 4.0), (0.0, 2.0), (0.5, 2.5)]) == pytest.approx(0.0)


def test_missing_source_is_one_line(tmp_path):
    with pytest.raises(peer.PeerError) as e:
        peer.check_source(tmp_path)
    assert "\n" not in str(e.value) and "benchmarks.anchor.peer fetch" in str(e.value)


def test_load_exported_reads_their_rmsnorm(tmp_path):
    m = build("gpt2", seed=0, vocab=64, hidden=16, layers=2, heads=4, mlp=40, positions=32, tie_word_embeddings=False)
    randomize_vectors(m)
    m.save_pretrained(tmp_path / "m")
    r = peer.load_exported(tmp_path / "m")
    norms = [x for x in r.modules() if isinstance(x, peer.RMSNorm)]
    assert len(norms) == 5 and not any(isinstance(x, torch.nn.LayerNorm) for x in r.modules())
    x = torch.randn(3, 16)
    ln = m.transformer.ln_f
    want = ln.weight * x / x.pow(2).mean(-1, keepdim=True).add(ln.eps).sqrt() + ln.bias
    torch.testing.assert_close(r.transformer.ln_f(x), want)


def test_report_has_the_peer_rows():
    from benchmarks.anchor.table import markdown
    info = {"commit": peer.PEER_COMMIT, "versions": {"torch": "2.13.0", "transformers": "4.50.1"},
            "b_loss_rel_change": 1e-7, "mid_loss_ours": 3.0, "mid_loss_their_merger": 3.0}
    row = lambda name, space, b, by=None, **kw: {"row": name, "space": space, "barrier": b, "barrier_theirs": b / 2,
                                                 "curve": [], "align_seconds": 1.5, "seconds": 2.0, "note": None,
                                                 **({"by": by, "peer": info} if by else {}), **kw}
    result = {"parent_test_loss": [5.0, 5.1], "protocol_note": "", "command": "cmd",
              "rows": [row("vanilla", "heads", 1.0), row("weights", "circuits", 0.1),
                       row("peer_weights", "circuits", 0.12, "peer"), row("peer_weights_proj", "heads", 0.2, "peer")]}
    md = markdown(result)
    assert peer.PEER_LABEL in md and "6b207cc" in md and "4.50.1" in md
    line = next(x for x in md.splitlines() if x.startswith("| peer_weights |"))
    assert "0.1200" in line and "0.0600" in line and "0.1000" in line  # peer, theirs, symgraph's same row


@pytest.fixture(scope="module")
def peer_env():
    work = peer.default_work()
    src, py = peer.source_dir(work), peer.python_of(peer.venv_dir(work))
    try:
        peer.check_source(src)
    except peer.PeerError:
        pytest.skip(f"peer source absent at {src} (python -m benchmarks.anchor.peer fetch)")
    if not py.exists():
        pytest.skip(f"peer venv absent at {py.parent.parent} (python -m benchmarks.anchor.peer venv)")
    return src, py


def _loss(model, ids) -> float:
    with torch.no_grad():
        lg = model(input_ids=ids).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1)))


@pytest.mark.slow
def test_their_weight_matching_keeps_b(peer_env, tmp_path):
    import symgraph
    src, py = peer_env
    models = []
    for s in (0, 1):  # their code expects GPT2LMHeadModel with its own output embedding
        m = build("gpt2", seed=s, vocab=64, hidden=16, layers=2, heads=4, mlp=40, positions=32,
                  tie_word_embeddings=False)
        randomize_vectors(m, seed=10 + s)  # gains ≠ 1: their absorption of the norms is exercised
        m.save_pretrained(tmp_path / f"p{s}")
        models.append(m)
    A, B = models
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(torch.bincount(torch.randint(0, 48, (400,), generator=torch.Generator().manual_seed(1)),
                              minlength=64), tmp_path / "freqs.pt")
    res = peer.run_glue(py, src, tmp_path / "p0", tmp_path / "p1", tmp_path / "out",
                        token_freqs=tmp_path / "freqs.pt", check_ids=tmp_path / "ids.pt", threads=1)
    assert [v["name"] for v in res["variants"]] == list(peer.VARIANTS)
    assert res["versions"]["transformers"] == "4.50.1"
    A_abs, B_abs = peer.load_exported(res["A"]), peer.load_exported(res["B"])
    la, lb = _loss(A, ids), _loss(B, ids)
    assert abs(_loss(A_abs, ids) - la) <= 1e-4 * la
    assert abs(_loss(B_abs, ids) - lb) <= 1e-4 * lb
    for v in res["variants"]:
        assert v["n_maps"] > 0 and v["seconds_weight_matching"] > 0
        assert v["replay_max_abs"] < 1e-4  # the replayed maps give their matched B (circuit form)
        for kind in ("noproj", "proj"):
            Bal = peer.load_exported(v["dirs"][kind])
            assert abs(_loss(Bal, ids) - lb) <= 1e-4 * lb, (v["name"], kind)
            moved = max(float((p - q).abs().max()) for p, q in zip(Bal.parameters(), B_abs.parameters()))
            assert moved > 1e-3, (v["name"], kind)
            mid = symgraph.interpolate(A_abs, Bal, [0.5], lambda m: _loss(m, ids), attention="circuits")[0][1]
            assert abs(mid - v["merger_mid_loss"][kind]) <= 1e-4 * mid, (v["name"], kind)
    assert res["variants"][2]["projection_is_identity"]  # permutations only: their projection rounds to I
    assert not res["variants"][0]["projection_is_identity"]


@pytest.mark.slow
def test_their_learned_matching_at_a_budget(peer_env, tmp_path):
    """Their train_merger.py loop, capped at 3 steps of batch 2: it trains (3 steps, their loss
    logged), and their learned projection replayed on B keeps B's loss (a symmetry) and moves it."""
    from benchmarks.tests.test_anchor_data import TOKENIZER
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"GPT-2 tokenizer files not in {TOKENIZER} (set ANCHOR_TOKENIZER)")
    src, py = peer_env
    for s in (0, 1):
        m = build("gpt2", seed=s, vocab=64, hidden=16, layers=2, heads=4, mlp=40, positions=32,
                  tie_word_embeddings=False)
        randomize_vectors(m, seed=10 + s)
        m.save_pretrained(tmp_path / f"p{s}")
    gen = torch.Generator().manual_seed(0)
    seqs = {k: torch.randint(0, 64, (n, 32), generator=gen) for k, n in (("train_ids", 12), ("val_ids", 4))}
    for k, v in seqs.items():
        torch.save(v, tmp_path / f"{k}.pt")
    torch.save(torch.bincount(torch.randint(0, 48, (400,), generator=gen), minlength=64), tmp_path / "freqs.pt")
    learn = {"batch_size": 2, "epochs": 10, "max_steps": 3, "tokenizer": str(TOKENIZER),
             **{k: str(tmp_path / f"{k}.pt") for k in seqs}}
    res = peer.run_glue(py, src, tmp_path / "p0", tmp_path / "p1", tmp_path / "out", variants=("weights_seen",),
                        token_freqs=tmp_path / "freqs.pt", threads=1, learned=("learned", "learned_perm"), learn=learn)
    assert [v["name"] for v in res["learned"]] == ["learned", "learned_perm"]
    B_abs = peer.load_exported(res["B"])
    ids = seqs["val_ids"]
    lb = _loss(B_abs, ids)
    for v in res["learned"]:
        assert v["steps"] == 3 and v["batch_size"] == 2 and v["permutations_only"] == (v["name"] == "learned_perm")
        Bl = peer.load_exported(v["dir"])
        assert abs(_loss(Bl, ids) - lb) <= 1e-4 * lb, v["name"]
        moved = max(float((p - q).abs().max()) for p, q in zip(Bl.parameters(), B_abs.parameters()))
        assert moved > 1e-3, v["name"]

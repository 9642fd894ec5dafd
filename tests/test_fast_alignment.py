"""The alignment's speed design: sparse assignment, the sweep tolerance, bf16 similarity
products, and checks that are not repeated (issue: alignment at the speed of the hardware)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

import symgraph
from symgraph.core.elements import Perm
from symgraph.solve import _solvers as SV
from symgraph.testing import models as M
from symgraph.testing import models


def _dense_objective(s):
    r, c = linear_sum_assignment(s, maximize=True)
    return s[r, c].sum(), c


def test_sparse_assignment_finds_the_dense_optimum(monkeypatch):
    """From ``SPARSE_N`` on, the assignment runs on each row's and column's top candidates;
    on noise with a planted permutation, and on pure noise, it finds the dense optimum."""
    monkeypatch.setattr(SV, "SPARSE_N", 256)
    rng = np.random.default_rng(0)
    n = 400
    for planted in (0.0, 1.5):
        P = rng.permutation(n)
        s = rng.standard_normal((n, n))
        s[np.arange(n), P] += planted * np.sqrt(np.log(n))
        s[0] = s[0].max() + 1.0  # row maxima collide: the assignment really runs
        res = SV.hungarian(torch.from_numpy(s), dense=False)
        obj, cols = _dense_objective(s)
        assert res.status.startswith("optimal among top-")
        assert res.objective == pytest.approx(obj, rel=1e-12)
        assert torch.equal(res.element.index, torch.as_tensor(cols))


def test_candidates_are_each_rows_and_columns_best_once():
    """The sparse assignment's candidates: each row's and each column's k largest entries,
    every edge once, with its value, on the similarity's own device."""
    rng = np.random.default_rng(3)
    n, k = 50, 4
    s = rng.standard_normal((n, n))
    rows, cols, vals = SV._candidates(torch.from_numpy(s), k)
    want = {(i, int(j)) for i in range(n) for j in np.argsort(-s[i])[:k]}
    want |= {(int(i), j) for j in range(n) for i in np.argsort(-s[:, j])[:k]}
    got = list(zip(rows.tolist(), cols.tolist()))
    assert len(got) == len(set(got)) and set(got) == want
    assert np.array_equal(vals, s[rows, cols]) and vals.dtype == np.float64


def test_sparse_assignment_falls_back_when_candidates_hold_no_matching(monkeypatch):
    """Every row's and column's best entry in one row / one column: the candidates hold no
    full matching, and the dense solve answers (the same optimum as SciPy's)."""
    monkeypatch.setattr(SV, "SPARSE_N", 8)
    monkeypatch.setattr(SV, "SPARSE_K", 1)
    n = 12
    rng = np.random.default_rng(1)
    s = rng.uniform(0, 0.1, (n, n))
    s[:, 0] += 5.0
    s[0, :] += 5.0
    assert SV._sparse_assignment(torch.from_numpy(s)) == (None, None, None)
    res = SV.hungarian(torch.from_numpy(s), dense=False)
    obj, cols = _dense_objective(s)
    assert res.status == "optimal" and res.objective == pytest.approx(obj, rel=1e-12)
    assert torch.equal(res.element.index, torch.as_tensor(cols))


def _pair(seed_b=1):
    return M.build("llama", seed=0), M.build("llama", seed=seed_b)


def _copy(A, seed=3):
    return symgraph.transform(A, symgraph.analyze(A).random_transform(seed=seed, orthogonal=True))


def test_tolerance_ends_the_sweeps_and_zero_takes_every_change():
    """``tol`` keeps an element whose re-solve gains at most that fraction of its objective:
    with a large tol the loop ends as soon as every class has been solved with all its slots
    (the first sweep solves some from partial slots); tol=0 sweeps on while anything moves."""
    A, B = _pair()
    loose = symgraph.align(A, B, tol=0.5)
    exact = symgraph.align(A, B, tol=0.0, max_iter=6)
    assert loose.seconds["sweeps"] <= 3 < exact.seconds["sweeps"]
    assert symgraph.align(A, B).seconds["sweeps"] == exact.seconds["sweeps"]  # the default is tol=0


def test_transformed_copy_recovered_exactly_with_the_defaults():
    """A tolerance keeps a transformed copy's exact first solve (LLaMA: no nested classes)."""
    A = M.build("llama", seed=0)
    B = _copy(A)
    al = symgraph.align(A, B, tol=1e-4)
    Bal = al.apply(B)
    for (n, p), q in zip(A.named_parameters(), Bal.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=0), n


def test_bf16_products_match_exact_on_a_bf16_transformed_copy():
    """similarity="bf16": every permutation of a transformed copy found as by exact products,
    and the rotations within bf16's precision."""
    A = M.build("llama", seed=0)
    B = _copy(A)
    A16, B16 = A.to(torch.bfloat16), B.to(torch.bfloat16)
    fast = symgraph.align(A16, B16, similarity="bf16")
    slow = symgraph.align(A16, B16, similarity="exact")
    moved = 0
    for gid, e in slow.elements.items():
        f = fast.elements[gid]
        if isinstance(e, Perm):
            assert torch.equal(e.index, f.index), gid
        elif isinstance(e, torch.Tensor):
            assert float((e.double() - f.double()).abs().max()) < 2e-2, gid
            moved += 1
    assert moved > 0


def test_similarity_and_tol_options_are_checked():
    A, B = _pair()
    with pytest.raises(symgraph.InputError, match="similarity="):
        symgraph.align(A, B, similarity="fp8")
    with pytest.raises(symgraph.InputError, match="tol="):
        symgraph.align(A, B, tol=-1)


def test_sketched_similarity_runs_through_the_projection_and_recovers_a_copy(monkeypatch):
    """sketch=k: every permutation class's matrix slot wider than 2k goes through the shared
    projection (counted), B's maps moved onto Ω; a transformed copy still comes back exactly
    (its matching rows stay each other's best under the projection), and on an unrelated
    pair the sketch changes the answer (it really is used)."""
    from symgraph.alignment import weights as W
    calls = []
    real = W.WeightFeatures._sketched
    monkeypatch.setattr(W.WeightFeatures, "_sketched", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    A = M.build("llama", seed=0)
    B = _copy(A)
    al = symgraph.align(A, B, sketch=8)
    assert calls
    for (n, p), q in zip(A.named_parameters(), al.apply(B).parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=0), n
    other = M.build("llama", seed=1)
    exact, sk = symgraph.align(A, other), symgraph.align(A, other, sketch=4)
    assert any(isinstance(e, Perm) and not torch.equal(e.index, sk.elements[g].index)
               for g, e in exact.elements.items())
    with pytest.raises(symgraph.InputError, match="sketch="):
        symgraph.align(A, other, sketch=-3)


@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_cli_sketch_streams_and_is_checked(tmp_path):
    """``symgraph merge --sketch K``: out of core like the exact merge, the option recorded;
    a negative K or a sketch without weight matching is one line, exit 2."""
    import json
    from conftest import build_hf, cli
    a, _ = build_hf("llama", 0)
    b, _ = build_hf("llama", 1)
    for m, d in ((a, "a"), (b, "b")):
        m.to(torch.bfloat16).save_pretrained(tmp_path / d)
    pa, pb = str(tmp_path / "a"), str(tmp_path / "b")
    r = cli("merge", pa, pb, "--out", str(tmp_path / "out"), "--sketch", "8")
    assert r.returncode == 0, r.stderr
    meta = json.load(open(tmp_path / "out" / "symgraph_merge.json"))
    assert meta["mode"] == "streaming" and meta["options"]["sketch"] == 8
    for args, msg in ((["--sketch", "-1"], "--sketch -1"), (["--sketch", "4", "--align", "none"], "expected --align weights")):
        r = cli("merge", pa, pb, "--out", str(tmp_path / "bad"), *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_cli_tol_ends_the_sweeps_sooner_and_is_checked(tmp_path):
    """``symgraph merge --tol X``: the sweep tolerance of ``symgraph.align`` from the command
    line and a config, recorded with the sweeps the alignment ran (fewer than the exact
    default's on an unrelated pair); a tol outside [0, 1) or without weight matching is one
    line, exit 2."""
    import json
    from conftest import build_hf, cli
    a, _ = build_hf("llama", 0)
    b, _ = build_hf("llama", 1)
    for m, d in ((a, "a"), (b, "b")):
        m.save_pretrained(tmp_path / d)
    pa, pb = str(tmp_path / "a"), str(tmp_path / "b")
    sweeps = {}
    for tol, rule, n in (("0", "exact", "6"), ("0.9", "exact", "6"), ("0", "discrete", "1")):
        out = tmp_path / f"out{tol}-{rule}-{n}"
        r = cli("merge", pa, pb, "--out", str(out), "--tol", tol, "--until", rule, "--max-iter", n)
        assert r.returncode == 0, r.stderr
        meta = json.load(open(out / "symgraph_merge.json"))
        assert meta["options"]["tol"] == float(tol) and meta["options"]["max_iter"] == int(n)
        assert meta["options"]["until"] == rule
        sweeps[tol, n] = meta["alignments"][0]["seconds"]["sweeps"]
    exact = symgraph.align(a, b, until="exact").seconds["sweeps"]
    assert sweeps["0", "6"] == exact > sweeps["0.9", "6"] >= 1, sweeps
    assert sweeps["0", "1"] == 1
    (tmp_path / "bad.yaml").write_text(f"models: [{pa}, {pb}]\nout: {tmp_path / 'bad'}\ntol: 1\n")
    for args, msg in ((["--tol", "-0.1"], "--tol -0.1; expected a relative gain in [0, 1)"),
                      (["--tol", "nan"], "--tol nan"),
                      (["--tol", "0.1", "--align", "none"], "--tol ends the sweeps of weight matching"),
                      (["--config", str(tmp_path / "bad.yaml")], "key 'tol' is 1 (int)")):
        r = cli("merge", *([] if args[0] == "--config" else [pa, pb, "--out", str(tmp_path / "bad")]), *args)
        said = r.stderr.strip().replace("\n  ", " ")  # one message, wrapped at 100 columns
        assert r.returncode == 2 and msg in said and "Traceback" not in said, r.stderr
        assert len(said.splitlines()) == 1, r.stderr
    assert not (tmp_path / "bad").exists()


def test_rows_of_unseen_tokens_are_left_out_of_weight_matching():
    """Theus et al. 2025 match the token embeddings of tokens seen in training only: the other
    rows of a trained model are its random initialisation. A transformed copy whose unseen
    embedding rows are redrawn is recovered exactly with ``rows=report.input_rows(data)``,
    and not without (those rows pull the residual rotation); a tied embedding (every row is
    trained as the head) gives no rows."""
    import transformers as tf
    from benchmarks.anchor import data as D
    torch.manual_seed(0)
    A = tf.GPT2LMHeadModel(D.config(vocab_size=400, n_layer=1, n_embd=32, n_head=2)).eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=2, orthogonal=True))
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = rep.input_rows([{"input_ids": ids}])
    assert list(rows) == ["transformer.wte.weight"] and torch.equal(rows["transformer.wte.weight"], ids.unique())
    unseen = torch.ones(400, dtype=torch.bool)
    unseen[ids.unique()] = False
    with torch.no_grad():
        B.transformer.wte.weight[unseen] = 0.5 * torch.randn(int(unseen.sum()), 32)
    A_seen = {k: v for k, v in A.state_dict().items() if k != "transformer.wte.weight"}

    def err(al):
        Bal = al.apply(B).state_dict()
        return max(float((v - Bal[k]).abs().max()) for k, v in A_seen.items() if v.is_floating_point())
    assert err(symgraph.align(A, B, rows=rows)) < 1e-5
    assert err(symgraph.align(A, B)) > 1e-2
    assert symgraph.analyze(M.build("gpt2", seed=0)).input_rows([{"input_ids": ids}]) == {}
    with pytest.raises(symgraph.InputError, match="rows=.*expected a mapping of parameter names to 1-D integer index"):
        symgraph.align(A, B, rows={"transformer.wte.weight": [1, 2]})


def test_deferral_skips_stable_units_without_changing_the_result():
    """Stable units (MLP permutations) wait while the rotations and heads converge: a
    transformed copy is still recovered exactly, and on a real pair every permutation is the
    one re-solving every unit each sweep finds."""
    A = M.build("llama", seed=0)
    C = _copy(A)
    al = symgraph.align(A, C)
    assert al.seconds["deferred"] > 0
    for (n, p), q in zip(A.named_parameters(), al.apply(C).parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), n
    B = M.build("llama", seed=1)
    on, off = symgraph.align(A, B), symgraph.align(A, B, defer=False)
    assert on.seconds["deferred"] > 0 and off.seconds["deferred"] == 0
    perms = [k for k, e in off.elements.items() if isinstance(e, Perm)]
    assert perms and all(torch.equal(on.elements[k].index, off.elements[k].index) for k in perms)


def test_pooled_contributions_equal_the_slot_sums_and_follow_the_permutations():
    """A residual stream's slots that read only permutations (the MLP's) are summed per set of
    dependencies and kept: the similarity equals the unpooled sum, reuses the pool while those
    permutations keep their version, and recomputes it when one changes."""
    from symgraph.alignment.weights import WeightFeatures
    A, B = M.build("llama", seed=0), M.build("llama", seed=1)
    ra, rb = symgraph.analyze(A), symgraph.analyze(B)
    al = symgraph.align(A, B, report_a=ra, report_b=rb)
    res = next(g for g in ra.groups if g.kind == "orthogonal" and not g.outer)
    perms = [k for k, e in al.elements.items() if isinstance(e, Perm)]
    pooled = WeightFeatures.from_models(ra, rb, A, B)
    plain = WeightFeatures.from_models(ra, rb, A, B)
    plain.POOL_BYTES = 0
    gb = rb.groups[ra.groups.index(res)]
    S0, _, _ = plain.similarity(res, gb, al.elements, False)
    S1, _, _ = pooled.similarity(res, gb, al.elements, False)
    assert pooled._pool and not plain._pool
    assert all(set(dep) <= set(perms) for _, dep, _ in pooled._pool)
    torch.testing.assert_close(S1, S0, rtol=1e-12, atol=1e-12)
    calls = []
    orig = pooled._slot
    pooled._slot = lambda *a, **k: calls.append(a[2]) or orig(*a, **k)
    S2, _, _ = pooled.similarity(res, gb, al.elements, False)
    torch.testing.assert_close(S2, S0, rtol=1e-12, atol=1e-12)
    assert calls == []  # everything from the pools and the per-slot cache
    # a permutation changes: its pool is recomputed, the similarity follows
    p = perms[0]
    els = dict(al.elements)
    els[p] = Perm(els[p].index.roll(1))
    for f in (pooled, plain):
        f.versions[p] = f.versions.get(p, 0) + 1
    S3, _, _ = pooled.similarity(res, gb, els, False)
    S4, _, _ = plain.similarity(res, gb, els, False)
    assert calls  # the changed pool's slots ran again
    torch.testing.assert_close(S3, S4, rtol=1e-12, atol=1e-12)
    assert float((S3 - S0).abs().max()) > 1e-6


@pytest.mark.parametrize("name", ["llama", "phi"])
def test_folded_reads_one_tensor_and_equals_the_whole_fold(tmp_path, name):
    """Out of core, a folded tensor is computed from its own fold part (gain, shift, its reader,
    its bias) in the 16-bit dtype where that is exact: bit for bit the whole fold in float32."""
    from conftest import build_hf
    from symgraph.checkpoints.sharded import Checkpoint
    from symgraph.merging.streaming import Folded
    a, _ = build_hf(name, 0)
    with torch.no_grad():  # gains and shifts that are not 1 and 0
        for n, p in a.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    a.to(torch.bfloat16).save_pretrained(tmp_path / "a")
    ck = Checkpoint(str(tmp_path / "a"))
    rep = symgraph.analyze(ck.model, fold_norms=True)
    assert rep.folds and (name != "phi" or any(f.shift for f in rep.folds))
    raw = {k: ck.get(k) for k in rep.parameters}
    whole = {k: v.to(raw[k].dtype) for k, v in rep.fold(raw, torch.float32).items()}
    lazy = Folded(rep, ck, budget=0, dtype=torch.float32)
    for k in whole:
        assert lazy[k].dtype == torch.bfloat16
        assert torch.equal(lazy[k], whole[k]), k


def test_head_maps_are_applied_block_by_block():
    """A head axis' map (a permutation of heads with a matrix per head) is kept as Blocks and
    applied per head: the same as the dense matrix, for a fraction of its cost; a map that
    mixes heads stays dense."""
    from symgraph.core.elements import Blocks, apply_along
    g = torch.Generator().manual_seed(0)
    H, b = 6, 4
    idx = torch.randperm(H, generator=g)
    R = torch.linalg.qr(torch.randn(H, b, b, generator=g, dtype=torch.float64))[0]
    M = torch.zeros(H, b, H, b, dtype=torch.float64)
    M[torch.arange(H), :, idx] = R
    M = M.reshape(H * b, H * b)
    B = Blocks.of(M, [b])
    assert B is not None and torch.equal(B.index, idx) and torch.equal(B.dense(), M)
    t = torch.randn(3, H * b, 5, generator=g, dtype=torch.float64)
    torch.testing.assert_close(apply_along(t, 1, B), apply_along(t, 1, M), rtol=0, atol=1e-14)
    M2 = M.clone()
    M2[0, -1] = 0.5  # head 0 reads another head too
    assert Blocks.of(M2, [b]) is None
    # in weight matching: the head axes of a LLaMA pair carry Blocks, and the alignment is the
    # one the dense maps give
    A, B2 = models.build("llama", seed=0), models.build("llama", seed=1)
    ra, rb = symgraph.analyze(A), symgraph.analyze(B2)
    al = symgraph.align(A, B2, report_a=ra, report_b=rb)
    kinds = {type(rb.axis_map(a, al.elements, blocks=True)).__name__
             for n in rb.parameters for a in rb.param_axes(n)}
    assert "Blocks" in kinds
    import symgraph.core.elements as E
    orig = E.Blocks.of
    try:
        E.Blocks.of = classmethod(lambda cls, M, sizes: None)
        dense = symgraph.align(A, B2, report_a=ra, report_b=rb)
    finally:
        E.Blocks.of = orig
    assert al.seconds["sweeps"] == dense.seconds["sweeps"]
    for k, e in dense.elements.items():
        if isinstance(e, Perm):
            assert torch.equal(al.elements[k].index, e.index), k
        else:
            torch.testing.assert_close(al.elements[k], e, rtol=0, atol=1e-9)


def test_statistics_of_16_bit_activations_in_float32_keep_the_covariance():
    """16-bit activations' cross products run in float32 on centred samples, the means added
    back in float64: with a mean 300 times the spread, the covariance equals the float64
    computation to float32's precision (raw float32 products would lose it to cancellation)."""
    from symgraph.alignment.activations import ActStats
    g = torch.Generator().manual_seed(0)
    mean = 300.0 * torch.randn(48, generator=g, dtype=torch.float64)
    base = torch.randn(4096, 48, generator=g, dtype=torch.float64)
    xa = (mean + base).to(torch.bfloat16)
    xb = (mean.flip(0) + base @ torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))[0]).to(torch.bfloat16)
    exact, fast = ActStats(), ActStats()
    for lo in range(0, 4096, 1024):  # in batches, as the passes add them
        exact.add(xa[lo:lo + 1024], xb[lo:lo + 1024], 0, torch.float64)
        fast.add(xa[lo:lo + 1024], xb[lo:lo + 1024], 0, torch.float32)
    C, Cf = exact.matrix("orthogonal")[0, 0], fast.matrix("orthogonal")[0, 0]
    assert float((C - Cf).abs().max()) <= 1e-5 * float(C.abs().max())
    raw = (xa.float().T @ xb.float()).double() / 4096 - torch.outer(exact.sa[0], exact.sb[0]) / 4096 ** 2
    assert float((C - raw).abs().max()) > 10 * float((C - Cf).abs().max())  # what centring avoids


def test_config_reads_exponent_floats(tmp_path):
    """``tol: 1e-3`` in a merge config is a number (YAML 1.2), not the string PyYAML's YAML 1.1
    rules make of it; strings that only look alike stay strings."""
    from symgraph.app.config import read_merge_config
    cfg = tmp_path / "m.yaml"
    cfg.write_text("models: [a, b]\nout: o\ntol: 1e-3\nweights: [2.5E-1, 75e-2]\nmethod: average\n")
    got = read_merge_config(str(cfg))
    assert got["tol"] == 1e-3 and got["weights"] == [0.25, 0.75]
    cfg.write_text("models: [1e-3, b]\nout: 2e5x\n")
    with pytest.raises(symgraph.InputError, match="'models'"):
        read_merge_config(str(cfg))  # a model path read as a number is refused by name, not used
    cfg.write_text("models: ['1e-3', b]\nout: 2e5x\n")
    assert read_merge_config(str(cfg))["models"][0].endswith("1e-3")


def test_output_rows_of_an_untied_head_are_left_out_like_the_embedding_rows():
    """Theus et al. 2025 leave out the untied head's rows of unseen tokens too (their
    ``weight_matching``: ``lm_head.weight.index_select(0, active_token_ids)``): a transformed copy
    whose unseen embedding AND head rows are redrawn is recovered exactly with the input and
    output rows, not with the input rows alone; a tied head gives no output rows; ids outside
    the vocabulary are refused."""
    import transformers as tf
    from benchmarks.anchor import data as D
    torch.manual_seed(0)
    A = tf.GPT2LMHeadModel(D.config(vocab_size=400, n_layer=1, n_embd=32, n_head=2)).eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    out_rows = rep.output_rows(ids)
    assert list(out_rows) == ["lm_head.weight"] and torch.equal(out_rows["lm_head.weight"], ids.unique())
    unseen = torch.ones(400, dtype=torch.bool)
    unseen[ids.unique()] = False
    with torch.no_grad():
        for p in (B.transformer.wte.weight, B.lm_head.weight):
            p[unseen] = 0.5 * torch.randn(int(unseen.sum()), 32)
    skip = ("transformer.wte.weight", "lm_head.weight")
    A_seen = {k: v for k, v in A.state_dict().items() if k not in skip}

    def err(al):
        Bal = al.apply(B).state_dict()
        return max(float((v - Bal[k]).abs().max()) for k, v in A_seen.items() if v.is_floating_point())
    both = {**rep.input_rows([{"input_ids": ids}]), **out_rows}
    assert err(symgraph.align(A, B, rows=both)) < 1e-5
    assert err(symgraph.align(A, B, rows=rep.input_rows([{"input_ids": ids}]))) > 1e-2
    assert symgraph.analyze(M.build("gpt2", seed=0)).output_rows(ids) == {}  # tied head
    with pytest.raises(symgraph.InputError, match=r"ids must lie in \[0, 400\)"):
        rep.output_rows([3, 400])


"""The residual-stream orthogonal group: norm gains folded into their readers, the stream
certified under dense orthogonal maps, and alignment recovering them exactly."""
import pytest
import torch

import symgraph
from symgraph import solve as S
from symgraph.transform.apply import transform
from symgraph.errors import InputError
from symgraph.core.groups import meet, sample
from symgraph.testing.models import build, randomize_vectors


def _model(arch, **kw):
    return randomize_vectors(build(arch, **kw), seed=1).double()


def _stream(report):
    """The residual stream: the class with the most parameter slots (every reader and
    writer of the stream)."""
    return max(report.groups, key=lambda g: len(g.params))


def _data(arch, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return [{"pixel_values": torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)}
                for _ in range(n)]
    return [{"input_ids": torch.randint(0, 64, (8, 16), generator=g)} for _ in range(n)]


def test_lattice_and_sampling():
    assert meet("orthogonal", "orthogonal_mean") == "orthogonal_mean"
    assert meet("orthogonal_mean", "signed_perm") == "perm"
    assert meet("orthogonal_mean", "scaled_perm") == "perm"
    assert meet("orthogonal_mean", "rope") == "identity"
    assert meet("gl", "orthogonal_mean") == "orthogonal_mean"
    Q = sample("orthogonal_mean", 7, torch.Generator().manual_seed(0), batch=(3,))
    ones = torch.ones(7, dtype=torch.float64)
    assert torch.allclose(Q @ Q.mT, torch.eye(7, dtype=torch.float64).expand(3, 7, 7), atol=1e-12)
    assert torch.allclose(Q @ ones, ones.expand(3, 7), atol=1e-12)
    # not a permutation: the group is continuous
    assert (Q.abs() > 1e-3).sum() > 3 * 7 * 2


def test_procrustes_mean_is_optimal_and_recovers_a_planted_map():
    g = torch.Generator().manual_seed(1)
    Q = sample("orthogonal_mean", 6, g)
    X = torch.randn(6, 40, generator=g, dtype=torch.float64)
    res = S.solve("orthogonal_mean", (Q @ X) @ X.T)
    assert torch.allclose(res.element, Q, atol=1e-10)
    Sim = torch.randn(6, 6, generator=g, dtype=torch.float64)
    best = S.procrustes_mean(Sim)
    ones = torch.ones(6, dtype=torch.float64)
    assert torch.allclose(best.element @ ones, ones, atol=1e-12)
    assert abs(best.objective - float((best.element * Sim).sum())) < 1e-10
    for k in range(200):  # no element of the group does better
        R = sample("orthogonal_mean", 6, g)
        assert float((R * Sim).sum()) <= best.objective + 1e-10
    # the unconstrained optimum is at least as good, and differs
    assert S.procrustes(Sim).objective >= best.objective - 1e-10


@pytest.mark.parametrize("arch,kw,kind", [
    ("llama", {}, "orthogonal"),
    ("gpt2", {"tie_word_embeddings": False}, "orthogonal_mean"),
    ("vit", {}, "orthogonal_mean"),
    ("neox", {}, "orthogonal_mean"),
])
def test_residual_group_is_certified(arch, kw, kind):
    m = _model(arch, **kw)
    r = symgraph.analyze(m)
    g = _stream(r)
    assert g.kind == kind
    assert r.folds and all(f.readers for f in r.folds)
    assert r.certify(m, trials=2, tol=1e-6) < 1e-6
    # the certificate is not vacuous: the stream element is a dense rotation
    T = r.random_transform(seed=0)
    E = T.element(g)
    assert (E.abs() > 1e-3).sum() > 2 * g.dim
    mt = transform(m, T)
    # gains stay in place (the fold is undone into the model's own gains)
    for f in r.folds:
        assert torch.equal(mt.get_parameter(f.gain), m.get_parameter(f.gain))
    # ... while the readers moved
    reader = r.folds[0].readers[0][0]
    assert not torch.allclose(mt.get_parameter(reader), m.get_parameter(reader))


@pytest.mark.parametrize("arch,kw", [("gpt2", {}), ("bert", {}), ("llama", {"tie_word_embeddings": True})])
def test_streams_without_the_group_stay_permutations(arch, kw):
    """A tied head reads the final norm's gain (it cannot absorb it without untying the
    embedding); BERT's post-LN streams feed gains into the residual sum. No fold widens the
    stream there, so none is made and the stream stays a permutation class."""
    m = _model(arch, **kw)
    r = symgraph.analyze(m)
    assert _stream(r).kind == "perm"
    assert r.folds == []
    assert r.certify(m, trials=1) < 1e-6


def test_a_forced_rotation_of_a_permutation_stream_breaks_the_model():
    """The other side of soundness: on tied GPT-2, a dense rotation of the stream (which the
    report does not claim) changes the outputs."""
    m = _model("gpt2")
    r = symgraph.analyze(m)
    g = _stream(r)
    T = r.random_transform(seed=0)
    T.elements[g.id] = sample("orthogonal_mean", g.dim, torch.Generator().manual_seed(0))
    args, kwargs = r.inputs
    with torch.no_grad():
        a, b = m(**kwargs).logits, transform(m, T)(**kwargs).logits
    assert (a - b).norm() / a.norm() > 1e-2


def test_fold_unfold_round_trip_and_canonical_function():
    m = _model("gpt2", tie_word_embeddings=False)
    r = symgraph.analyze(m)
    tensors = {k: p.detach() for k, p in m.named_parameters()}
    folded = {**tensors, **r.fold(tensors)}
    for f in r.folds:
        assert torch.equal(folded[f.gain], torch.ones_like(folded[f.gain]))
    keep = [f for f in r.folds if f.keep_shift]
    assert keep and all(f.shift for f in keep)  # the final norm's shift stays (lm_head has no bias)
    back = r.unfold(folded, tensors)
    for k, v in back.items():
        assert torch.allclose(v, tensors[k].double(), rtol=1e-12, atol=1e-12), k
    # the folded model (gains 1) computes the same function
    m2 = symgraph.transform(m, symgraph.Transform(r, {}))
    canon = type(m)(m.config).double().eval()
    canon.load_state_dict({**m.state_dict(), **{k: v for k, v in folded.items()}}, strict=False)
    args, kwargs = r.inputs
    with torch.no_grad():
        ref = m(**kwargs).logits
        assert torch.allclose(canon(**kwargs).logits, ref, atol=1e-10)
        assert torch.allclose(m2(**kwargs).logits, ref, atol=1e-10)


def test_zero_gain_is_refused_with_one_line():
    m = _model("gpt2", tie_word_embeddings=False)
    r = symgraph.analyze(m)
    with torch.no_grad():
        m.get_parameter(next(f.gain for f in r.folds if f.keep_shift))[3] = 0.0
    with pytest.raises(InputError, match="zero entries.*fold_norms=False"):
        symgraph.transform(m, r.random_transform(seed=0))


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("gpt2", {"tie_word_embeddings": False}), ("vit", {})])
@pytest.mark.parametrize("how", ["weights", "activations"])
@pytest.mark.slow
def test_exact_recovery_with_a_residual_rotation(arch, kw, how):
    A = _model(arch, **kw)
    r = symgraph.analyze(A)
    assert _stream(r).kind in ("orthogonal", "orthogonal_mean")
    B = transform(A, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(A, B, data=_data(arch) if how == "activations" else None)
    Bt = al.apply(B)
    pa = dict(A.named_parameters())
    worst = max(((pa[k] - p).abs().max() / pa[k].abs().max().clamp_min(1e-12)).item()
                for k, p in Bt.named_parameters())
    assert worst < 1e-6


def test_fold_norms_false_keeps_permutations():
    m = _model("llama")
    r = symgraph.analyze(m, fold_norms=False)
    assert _stream(r).kind == "perm" and r.folds == []
    al = symgraph.align(m, m, fold_norms=False)
    assert al.report_a.folds == []


def test_tied_embeddings_stay_tied_after_alignment():
    A, B = _model("llama", tie_word_embeddings=True), _model("llama", tie_word_embeddings=True)
    with torch.no_grad():
        for p in B.parameters():
            p.add_(0.1 * torch.randn_like(p))
    Bt = symgraph.align(A, B).apply(B)
    assert Bt.lm_head.weight.data_ptr() == Bt.model.embed_tokens.weight.data_ptr()


def test_regmean_statistics_run_on_the_models_own_tensors():
    """With norm folds, merge measures B's statistics on B aligned, through A's report: the
    Grams must be B's (a report's graph carries the tensors it was traced with)."""
    from statistics_reference import input_grams
    A, B = _model("llama"), _model("llama")
    with torch.no_grad():
        for p in B.parameters():
            p.mul_(1.5)
    ra, rb = symgraph.analyze(A), symgraph.analyze(B)
    data = [ra.inputs[1]]
    mine, through_a = input_grams(B, rb, data), input_grams(B, ra, data)
    theirs = input_grams(A, ra, data)
    for k in mine:
        assert torch.allclose(mine[k], through_a[k])
        assert not torch.allclose(mine[k], theirs[k])
    avg = symgraph.merge([A, B], data=data, method="average").model
    reg = symgraph.merge([A, B], data=data, method="regmean").model
    w = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(avg.get_parameter(w), reg.get_parameter(w), atol=1e-4)


@pytest.mark.slow  # over 30 s on 2 cores; the default suite keeps a faster test of this path
def test_cli_analyze_reports_folds_and_can_keep_permutations():
    import json

    from conftest import cli

    def run(*a):
        r = cli("analyze", "tiny-llama", *a, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout
    folded = json.loads(run("--json"))
    plain = json.loads(run("--json", "--no-fold-norms"))
    assert folded["groups"][0]["kind"] == "orthogonal" and len(folded["folds"]) == 5
    assert plain["groups"][0]["kind"] == "perm" and plain["folds"] == []
    assert "norm gains fold into the layers that read them" in run()


def test_sequence_classification_pooled_by_index_keeps_the_stream():
    """LlamaForSequenceClassification picks each row's last token with two index tensors
    (batch, position): a token-axis op that must not freeze the channels."""
    import transformers

    from symgraph.testing.models import config
    cfg = config("llama")
    cfg.num_labels, cfg.pad_token_id = 3, 0
    m = randomize_vectors(transformers.LlamaForSequenceClassification(cfg).eval(), seed=1).double()
    r = symgraph.analyze(m)
    assert r.frozen == [] and _stream(r).kind == "orthogonal"
    assert r.certify(m, trials=1) < 1e-6

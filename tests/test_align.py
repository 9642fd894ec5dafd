"""Alignment and merging (issue #3): exact recovery, widening, trained pairs, bad input."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, ViTConfig, ViTForImageClassification)

import symgraph
import symgraph.cli.demo

transformers.logging.set_verbosity_error()
V = 50


def _bert():
    return BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=32))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32))


def _llama(**kw):
    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _vit():
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, num_labels=3))


BUILDERS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "vit": _vit}


def _batches(name, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return [(torch.randn(2, 3, 16, 16, generator=g),) for _ in range(n)]
    return [(torch.randint(0, V, (2, 8), generator=g),) for _ in range(n)]


def _rel_params(a, b):
    num = sum(((p.double() - q.double()) ** 2).sum() for p, q in zip(a.parameters(), b.parameters()))
    den = sum((p.double() ** 2).sum() for p in a.parameters())
    return float((num / den).sqrt())


def _logits(m, x):
    with torch.no_grad():
        m.eval()
        out = m(*x, **({"use_cache": False} if "use_cache" in m.forward.__code__.co_varnames else {}))
        return out.logits


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("mode", ["weights", "activations"])
def test_exact_recovery(name, mode):
    torch.manual_seed(0)
    A = BUILDERS[name]().eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=5, orthogonal=True))
    assert _rel_params(A, B) > 0.1  # B really is scrambled
    before = copy.deepcopy(B.state_dict())
    data = _batches(name) if mode == "activations" else None
    al = symgraph.align(A, B, data=data)
    C = al.apply(B)
    assert _rel_params(A, C) < 1e-6
    for k, v in B.state_dict().items():  # B untouched
        assert torch.equal(v, before[k])
    merged = symgraph.merge([A, B], data=data, align=mode).model
    x = _batches(name, 1, seed=9)[0]
    la, lm = _logits(A, x), _logits(merged, x)
    assert float((la - lm).norm() / la.norm()) < 1e-5
    naive = symgraph.merge([A, B], align=None).model
    assert float((la - _logits(naive, x)).norm() / la.norm()) > 1e-2


def _widen_mlp(A, perm_seed=0):
    """GPT-2 with every MLP unit duplicated, outgoing weights split, units shuffled."""
    cfg = copy.deepcopy(A.config)
    cfg.n_inner = 2 * (A.config.n_inner or 4 * A.config.n_embd)
    B = GPT2LMHeadModel(cfg).eval()
    sd = {k: v.clone() for k, v in A.state_dict().items()}
    g = torch.Generator().manual_seed(perm_seed)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}.mlp."
        n = A.get_parameter(p + "c_fc.bias").shape[0]
        order = torch.randperm(2 * n, generator=g)
        w_in = torch.cat([sd[p + "c_fc.weight"]] * 2, 1)[:, order]   # Conv1D [in, out]
        b_in = torch.cat([sd[p + "c_fc.bias"]] * 2)[order]
        w_out = (torch.cat([sd[p + "c_proj.weight"]] * 2, 0) / 2)[order]
        sd[p + "c_fc.weight"], sd[p + "c_fc.bias"], sd[p + "c_proj.weight"] = w_in, b_in, w_out
    B.load_state_dict(sd, strict=False)
    return B


def test_widening_mlp_fuses_back():
    torch.manual_seed(0)
    A = _gpt2().eval()
    B = _widen_mlp(A)
    x = _batches("gpt2", 1, seed=3)[0]
    lb, la = _logits(B, x), _logits(A, x)
    assert float((la - lb).norm() / la.norm()) < 1e-5  # the widening preserves the function
    merged = symgraph.merge([A, B]).model
    assert merged.get_parameter("transformer.h.0.mlp.c_fc.weight").shape == (32, 128)
    assert float((la - _logits(merged, x)).norm() / la.norm()) < 1e-4


def test_widening_heads_fuses_back():
    torch.manual_seed(0)
    A = _llama(num_attention_heads=4, num_key_value_heads=4, head_dim=8).eval()
    cfg = copy.deepcopy(A.config)
    cfg.num_attention_heads = cfg.num_key_value_heads = 8
    B = LlamaForCausalLM(cfg).eval()
    sd = {k: v.clone() for k, v in A.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for w in ("q_proj", "k_proj", "v_proj"):
            W = sd[p + w + ".weight"].reshape(4, 8, -1)
            sd[p + w + ".weight"] = torch.stack([W, W], 1).reshape(64, -1)
        O = sd[p + "o_proj.weight"].reshape(-1, 4, 8)
        sd[p + "o_proj.weight"] = (torch.stack([O, O], 2) / 2).reshape(O.shape[0], 64)
    B.load_state_dict(sd)
    x = _batches("llama", 1, seed=3)[0]
    la = _logits(A, x)
    assert float((la - _logits(B, x)).norm() / la.norm()) < 1e-5
    merged = symgraph.merge([A, B]).model
    assert merged.config.num_attention_heads == 4
    assert float((la - _logits(merged, x)).norm() / la.norm()) < 1e-4


def _train_mlp(seed, X, y, steps=300):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(X.shape[1], 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(X), y).backward()
        opt.step()
    return m


def test_trained_pair_aligned_merge_beats_vanilla():
    from sklearn.datasets import load_digits
    d = load_digits()
    X = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    A, B = _train_mlp(0, X, y), _train_mlp(1, X, y)
    loss = lambda m: float(torch.nn.functional.cross_entropy(m(X), y))  # noqa: E731
    inputs = (X[:64],)
    vanilla = loss(symgraph.merge([A, B], inputs, align=None).model)
    by_w = loss(symgraph.merge([A, B], inputs, align="weights").model)
    data = [(X[i:i + 64],) for i in range(0, 1024, 64)]
    by_a = loss(symgraph.merge([A, B], align="activations", data=data).model)
    assert by_w < vanilla and by_a < vanilla
    curve = symgraph.interpolate(A, B, None, loss)
    assert len(curve) == 21 and curve[0][0] == 0.0 and curve[-1][0] == 1.0
    assert symgraph.loss_barrier(curve) > 0


def test_bad_inputs():
    torch.manual_seed(0)
    A, G = _bert().eval(), _gpt2().eval()
    with pytest.raises(symgraph.StructureMismatchError, match="'model_a' is a BertForMaskedLM but 'model_b' is a GPT2"):
        symgraph.align(A, G)
    cfg = copy.deepcopy(A.config)
    cfg.vocab_size = 60
    A2 = BertForMaskedLM(cfg).eval()
    with pytest.raises(symgraph.StructureMismatchError, match="vocabular"):
        symgraph.align(A, A2, inputs=(torch.randint(0, 50, (2, 8)),))
    Bn = copy.deepcopy(A)
    with torch.no_grad():
        Bn.get_parameter("bert.encoder.layer.0.output.dense.weight")[0, 0] = float("nan")
    with pytest.raises(symgraph.InputError, match="layer.0.output.dense.weight"):
        symgraph.align(A, Bn)
    with pytest.raises(symgraph.InputError, match="expected 1"):
        symgraph.align(A, copy.deepcopy(A), data=[(torch.randint(0, 50, (2, 8)),),
                                                 (torch.randint(0, 50, (3, 8)), torch.ones(3, 8))])
    with pytest.raises(symgraph.InputError, match="at least 2"):
        symgraph.merge([A])
    with pytest.raises(symgraph.InputError, match="needs data"):
        symgraph.merge([A, copy.deepcopy(A)], method="fisher")


def _byte_batches(stream, n, rows, seed, seq=32):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq, (n, rows), generator=g)
    return [torch.stack([stream[s:s + seq] for s in row.tolist()]) for row in starts]


def _trained_lm(arch, seed, stream, steps=150):
    torch.manual_seed(seed)
    if arch == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:  # GQA, RoPE, SwiGLU, RMSNorm
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=64, max_position_embeddings=32))
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    for x in _byte_batches(stream, steps, 16, 100 + seed):  # seed-dependent data order too
        opt.zero_grad()
        m(x, labels=x).loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.slow
def test_trained_transformers_aligned_merge_beats_vanilla(arch, one_thread):
    """Two byte-level LMs trained for a few seconds from different seeds (init and data order)
    on pydoc prose: merged at λ=0.5, alignment by weights and by activations both give a lower
    held-out loss than plain averaging."""
    train, held = symgraph.cli.demo.corpus()
    A, B = _trained_lm(arch, 0, train), _trained_lm(arch, 1, train)
    ev = _byte_batches(held, 4, 32, 7)

    def loss(m):
        with torch.no_grad():
            return sum(float(m(x, labels=x).loss) for x in ev) / len(ev)
    la, lb = loss(A), loss(B)
    vanilla = loss(symgraph.merge([A, B], (ev[0][:2],), align=None).model)
    by_w = loss(symgraph.merge([A, B], (ev[0][:2],), align="weights").model)
    by_a = loss(symgraph.merge([A, B], align="activations", data=_byte_batches(train, 4, 16, 5)).model)
    assert vanilla > max(la, lb) + 0.2  # a real barrier to remove
    assert by_w < vanilla - 0.1 and by_a < vanilla - 0.1, (la, lb, vanilla, by_w, by_a)


def test_widening_hidden_fuses_back():
    """Every residual-stream unit duplicated (RMSNorm statistics unchanged), readers' weights
    halved: B computes A's function at twice the hidden width; the merge returns A's width."""
    torch.manual_seed(0)
    A = _llama(num_key_value_heads=4, tie_word_embeddings=False).eval()
    cfg = copy.deepcopy(A.config)
    cfg.hidden_size = 64
    cfg.head_dim = A.config.hidden_size // A.config.num_attention_heads
    B = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(64, generator=g)
    dup = lambda t, d: torch.cat([t, t], d).index_select(d, order)  # noqa: E731
    sd = {}
    for k, v in A.state_dict().items():
        if k.endswith("embed_tokens.weight"):
            sd[k] = dup(v, 1)
        elif k.endswith(("norm.weight",)):
            sd[k] = dup(v, 0)
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = dup(v, 0)  # writers into the stream
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                         "up_proj.weight", "lm_head.weight")):
            sd[k] = dup(v, 1) / 2  # readers of the stream
        else:
            sd[k] = v
    B.load_state_dict(sd)
    x = _batches("llama", 1, seed=3)[0]
    la = _logits(A, x)
    assert float((la - _logits(B, x)).norm() / la.norm()) < 1e-5
    merged = symgraph.merge([A, B]).model
    assert merged.config.hidden_size == 32
    assert merged.get_parameter("model.embed_tokens.weight").shape == (V, 32)
    assert float((la - _logits(merged, x)).norm() / la.norm()) < 1e-4


def test_rescale_recovers_per_head_scaling():
    """B = A moved by rotations *and* per-head scalars on the GL (QK, VO) classes: rotations
    alone leave B off A by the scalars; ``rescale=True`` (Zhang et al. 2024) fits them back exactly."""
    torch.manual_seed(0)
    A = _bert().eval()
    rep = symgraph.analyze(A)
    t = rep.random_transform(seed=2, orthogonal=True)
    g = torch.Generator().manual_seed(3)
    for grp in rep.groups:
        if grp.kind == "gl":
            E = t.elements[grp.id]
            t.elements[grp.id] = E * (0.5 + 1.5 * torch.rand(E.shape[0], 1, 1, generator=g, dtype=torch.float64))
    B = symgraph.transform(A, t)
    plain = symgraph.align(A, B)
    assert _rel_params(A, plain.apply(B)) > 1e-2
    al = symgraph.align(A, B, rescale=True)
    assert _rel_params(A, al.apply(B)) < 1e-6
    assert set(al.scales) == {grp.id for grp in rep.groups if grp.kind == "gl"}
    x = _batches("bert", 1, seed=4)[0]
    la = _logits(A, x)
    assert float((la - _logits(al.apply(B), x)).norm() / la.norm()) < 1e-5


def _more_architectures():
    """Models the analysis and alignment were not written against (no per-model code)."""
    tf = transformers
    return {
        "distilbert": lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
            vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32)),
        "roberta": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(  # fused QKV, partial rotary
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, rotary_pct=0.5)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(  # interleaved RoPE, parallel block
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(  # ReLU: positive scaling of MLP units
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=32, word_embed_proj_dim=32)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(  # multi-query attention
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=8, intermediate_size=64, max_position_embeddings=32)),
    }


@pytest.mark.parametrize("name", list(_more_architectures()))
@pytest.mark.slow
def test_exact_recovery_more_architectures(name, one_thread):
    torch.manual_seed(0)
    A = _more_architectures()[name]().eval()
    rep = symgraph.analyze(A)
    B = symgraph.transform(A, rep.random_transform(seed=1, orthogonal=True))
    assert _rel_params(A, B) > 0.1
    assert _rel_params(A, symgraph.align(A, B, report_a=rep).apply(B)) < 1e-6
    data = _batches(name)
    assert _rel_params(A, symgraph.align(A, B, data=data, report_a=rep).apply(B)) < 1e-6


@pytest.mark.parametrize("inner", ["hungarian", "procrustes"])
def test_heads_paired_by_index_when_head_class_not_selected(inner):
    """``groups=`` leaving the head permutation out (Zhang et al. 2024's setting): heads stay paired by
    index and each head's inner element is solved, by assignment or by rotation."""
    torch.manual_seed(0)
    A = _bert().eval()
    rep = symgraph.analyze(A)
    heads = {o for g in rep.groups for o in g.outer}
    t = rep.random_transform(seed=1, orthogonal=True)
    g = torch.Generator().manual_seed(2)
    for grp in rep.groups:
        if grp.id in heads:
            t.elements[grp.id] = torch.eye(grp.size, dtype=torch.float64)
        elif grp.outer:  # permutations inside each head: what both inner solvers can recover
            eye = torch.eye(grp.dim, dtype=torch.float64)
            t.elements[grp.id] = torch.stack([eye[torch.randperm(grp.dim, generator=g)]
                                                for _ in range(grp.blocks)])
    B = symgraph.transform(A, t)
    al = symgraph.align(A, B, groups=lambda grp: grp.id not in heads, inner=inner)
    assert not any(grp.id in al.results for grp in rep.groups if grp.id in heads)
    assert _rel_params(A, al.apply(B)) < 1e-6


@pytest.mark.slow
def test_data_of_any_batch_size_and_length():
    """Batches of other shapes than the traced one are traced again: alignment from them is
    still exact, and RegMean / Fisher merges of a model with its transformed copy keep its
    function."""
    torch.manual_seed(0)
    A = _gpt2().eval()
    B = symgraph.transform(A, symgraph.analyze(A).random_transform(seed=1, orthogonal=True))
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(0, 50, shape, generator=g)} for shape in ((2, 8), (3, 12), (1, 5))]
    C = symgraph.align(A, B, data=data).apply(B)
    assert _rel_params(A, C) < 1e-6
    x = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    for method in ("regmean", "fisher"):
        merged = symgraph.merge([A, B], data=data, align="activations", method=method).model
        la, lm = _logits(A, (x["input_ids"],)), _logits(merged, (x["input_ids"],))
        assert float((la - lm).norm() / la.norm()) < 1e-5, method


@pytest.mark.parametrize("solver,reg", [("ot", None), ("sinkhorn", 1e-3)])
def test_transport_solvers_recover_a_permuted_copy(solver, reg):
    """An exact transport plan between equal widths is a permutation / n: it must act as that
    permutation (it used to be applied raw, scaling weights by 1/n); a sharp Sinkhorn map too."""
    torch.manual_seed(0)
    A = _gpt2().eval()
    B = symgraph.transform(A, symgraph.analyze(A).random_transform(seed=2, orthogonal=True))
    al = symgraph.align(A, B, solver=solver, reg=reg)
    assert _rel_params(A, al.apply(B)) < 1e-6
    if solver == "ot":  # head and unit permutations come out as permutations
        assert all(not isinstance(e, symgraph.core.elements.Map) for e in al.elements.values())


class _TanhMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 12), torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_odd_activations_are_recovered_as_signed_permutations():
    """tanh is odd: a unit may flip the signs of its input and output weights. The report says
    signed_perm, random_transform flips signs, and weight and activation matching (and learned
    matching) recover the copy exactly, signs included."""
    torch.manual_seed(0)
    A, x = _TanhMLP().eval(), torch.randn(8, 6)
    rep = symgraph.analyze(A, (x,))
    assert [g.kind for g in rep.groups] == ["signed_perm", "signed_perm"]
    B = symgraph.transform(A, rep.random_transform(seed=0))
    dev = lambda m: max(float((p - q).abs().max()) for p, q in zip(A.parameters(), m.parameters()))  # noqa: E731
    assert dev(B) > 0.1
    data = [(torch.randn(32, 6),) for _ in range(3)]
    for al in (symgraph.align(A, B, (x,)), symgraph.align(A, B, (x,), data=data),
               symgraph.align(A, B, (x,), data=data, refine=3, loss_fn=lambda m, b: m(*b).pow(2).mean())):
        assert dev(al.apply(B)) < 1e-6
        assert any(bool((al.elements[g.id] < 0).any()) for g in rep.groups)  # signs were flipped back

"""``symgraph.analyze`` on real architectures: soundness (certificates), completeness (the
groups every layer must have, with their exact parameter slots); partial and interleaved
rotary in ``test_analyze_rotary.py``, the report's behaviour in ``test_analyze_report.py``.
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.core.groups import PERMUTATION_FAMILY

from analyze_helpers import MLP, TOL, in_layer, names, one, rel_change, slots

ALL = ["bert", "gpt2", "llama", "vit", "encoder", "mlp"]


# --- 1. soundness: certificates, and the transforms really move the weights ---------------
@pytest.mark.parametrize("tiny", ALL, indirect=True)
def test_certificate(tiny):
    worst = tiny.report.certify(tiny.model, inputs=tiny.inputs)
    assert 0.0 <= worst <= TOL
    assert len(tiny.report.groups) > 0
    assert tiny.report.frozen == []  # every op of these models has a rule


@pytest.mark.parametrize("tiny", ALL, indirect=True)
def test_transform_moves_weights_and_leaves_model_alone(tiny):
    model, report = tiny.model, tiny.report
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = symgraph.transform(model, report.random_transform(seed=1))
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:  # the original is bit-identical
        assert torch.equal(before[k], after[k]), k
    moved = {p for g in report.groups for p, _ in g.params}
    assert moved, "no group has parameter slots"
    new_params = dict(new.named_parameters())
    for name in moved:
        change = rel_change(model.get_parameter(name), new_params[name])
        assert change > 0.1, f"{name} moved only by {change:.3g}"
    folded = {n for f in report.folds for n in (f.shift, *(b for _, _, b in f.readers)) if n}
    untouched = (set(new_params) - moved - folded
                 - {a for al in report.aliases.values() for a in al})
    for name in untouched:  # parameters in no group (nor in a norm fold) keep their values
        assert torch.equal(model.get_parameter(name), new_params[name]), name
    # and the transformed copy computes the same function (float32 here: loose tolerance)
    args, kwargs = report._inputs if tiny.inputs is None else (tiny.inputs, {})
    with torch.no_grad():
        a, b = model(*args, **kwargs), new(*args, **kwargs)
    a = a if isinstance(a, torch.Tensor) else a[0]
    b = b if isinstance(b, torch.Tensor) else b[0]
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-4)


def test_orthogonal_part_certifies(llama, bert):
    for tiny in (llama, bert):
        t = tiny.report.random_transform(seed=5, orthogonal=True)
        for g in tiny.report.groups:
            E = t.element(g).reshape(-1, g.dim, g.dim)
            eye = torch.eye(g.dim, dtype=torch.float64)
            assert torch.allclose(E @ E.mT, eye.expand_as(E), atol=1e-10), g.kind


# --- 2. completeness ----------------------------------------------------------------------
@pytest.mark.parametrize("tiny", list(MLP), indirect=True)
def test_one_mlp_permutation_per_layer(tiny):
    prefix, (up, dim), width_attr = MLP[tiny.name]
    width = getattr(tiny.config, width_attr)
    for i in range(tiny.config.num_hidden_layers):
        pre = prefix.format(i=i)
        perms = [g for g in in_layer(tiny.report.groups, pre)
                 if g.kind in PERMUTATION_FAMILY and g.size == width]
        g = one(perms, f"MLP permutation in {pre}")
        assert (pre + up, dim) in g.params
        assert g.blocks == 1 and g.dim == width


def test_mlp_permutation_slots(llama):
    for i in range(2):
        pre = f"model.layers.{i}.mlp."
        g = one([g for g in llama.report.groups if (pre + "up_proj.weight", 0) in g.params], "MLP group")
        assert g.kind == "perm"  # SiLU gate times up: only permutations
        assert slots(g) == {(pre + "gate_proj.weight", 0), (pre + "up_proj.weight", 0),
                            (pre + "down_proj.weight", 1)}
        assert dict(zip(g.params, g.variance))[(pre + "down_proj.weight", 1)] == "contra"


ATTN = {  # q, k, v weights (param, head-axis dim), output projection (param, in dim), biases
    "bert": ("attention.self.query", "attention.self.key", "attention.self.value",
             "attention.output.dense"),
    "vit": ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj"),
}


def _head_groups(report, pre, heads, head_dim):
    groups = in_layer(report.groups, pre)
    qk = [g for g in groups if g.kind == "gl" and g.blocks == heads and g.dim == head_dim]
    hp = one([g for g in groups if g.kind == "perm" and g.size == heads and g.blocks == 1],
             f"head permutation in {pre}")
    return qk, hp


@pytest.mark.parametrize("tiny", ["bert", "vit"], indirect=True)
def test_head_groups_separate_qkv(tiny):
    cfg = tiny.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    prefix = MLP[tiny.name][0]
    q, k, v, o = ATTN[tiny.name]
    for i in range(cfg.num_hidden_layers):
        pre = prefix.format(i=i)
        gl, hp = _head_groups(tiny.report, pre, heads, head_dim)
        assert len(gl) == 2, [(g.kind, g.size, g.blocks) for g in gl]
        qk = one([g for g in gl if (pre + q + ".weight", 0) in g.params], "QK group")
        vo = one([g for g in gl if (pre + v + ".weight", 0) in g.params], "VO group")
        # exact slots: Q and K rows (and biases), K contravariant
        assert slots(qk) == {(pre + q + ".weight", 0), (pre + q + ".bias", 0),
                             (pre + k + ".weight", 0), (pre + k + ".bias", 0)}
        var = dict(zip(qk.params, qk.variance))
        assert var[(pre + q + ".weight", 0)] == "co" and var[(pre + k + ".weight", 0)] == "contra"
        assert slots(vo) == {(pre + v + ".weight", 0), (pre + v + ".bias", 0), (pre + o + ".weight", 1)}
        assert dict(zip(vo.params, vo.variance))[(pre + o + ".weight", 1)] == "contra"
        for g in (qk, vo):
            assert g.size == heads * head_dim
            assert g.outer == [hp.id]
        # the head permutation acts on Q, K, V rows and the output's columns together
        assert slots(hp) >= {(pre + x + ".weight", 0) for x in (q, k, v)} | {(pre + o + ".weight", 1)}


def test_head_groups_gpt2_fused_qkv(gpt2):
    cfg = gpt2.config
    heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
    for i in range(cfg.n_layer):
        pre = f"transformer.h.{i}.attn."
        gl, hp = _head_groups(gpt2.report, f"transformer.h.{i}.", heads, head_dim)
        assert len(gl) == 2
        # Conv1D: c_attn.weight is [in, 3*out]; Q and K are segments of the same slot
        qk = one([g for g in gl if (pre + "c_proj.weight", 0) not in g.params], "QK group")
        vo = one([g for g in gl if (pre + "c_proj.weight", 0) in g.params], "VO group")
        assert sorted(zip(qk.params, qk.variance)) == sorted([
            ((pre + "c_attn.weight", 1), "co"), ((pre + "c_attn.weight", 1), "contra"),
            ((pre + "c_attn.bias", 0), "co"), ((pre + "c_attn.bias", 0), "contra")])
        assert slots(vo) == {(pre + "c_attn.weight", 1), (pre + "c_attn.bias", 0),
                             (pre + "c_proj.weight", 0)}
        assert qk.outer == vo.outer == [hp.id]
        assert (pre + "c_proj.weight", 0) in hp.params


def test_llama_gqa_groups(llama):
    cfg = llama.config
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    assert kv < heads
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.self_attn."
        groups = in_layer(llama.report.groups, pre)
        rope = one([g for g in groups if g.kind == "rope"], "rope QK group")
        assert (rope.blocks, rope.dim) == (kv, head_dim)
        assert slots(rope) == {(pre + "q_proj.weight", 0), (pre + "k_proj.weight", 0)}
        assert rope.pairs == tuple((j, j + head_dim // 2) for j in range(head_dim // 2))  # rotate_half
        vo = one([g for g in groups if g.kind == "gl"], "VO group")
        assert (vo.blocks, vo.dim) == (kv, head_dim)
        assert slots(vo) == {(pre + "v_proj.weight", 0), (pre + "o_proj.weight", 1)}
        kvp = one([g for g in groups if g.kind == "perm" and g.size == kv], "KV-head permutation")
        assert slots(kvp) == {(pre + x + "_proj.weight", 0) for x in "qkv"} | {(pre + "o_proj.weight", 1)}
        assert rope.outer == vo.outer == [kvp.id]
        # query heads sharing a KV head may be permuted among themselves (per KV head)
        rep = one([g for g in groups if g.kind == "perm" and g.blocks > 1], "query-in-group perm")
        assert (rep.blocks, rep.dim, rep.outer) == (kv, heads // kv, [kvp.id])
        assert slots(rep) == {(pre + "q_proj.weight", 0), (pre + "o_proj.weight", 1)}


RESIDUAL = {  # embedding slots, per-layer norms, final norms
    "bert": ([("bert.embeddings.word_embeddings.weight", 1), ("bert.embeddings.position_embeddings.weight", 1),
              ("bert.embeddings.token_type_embeddings.weight", 1), ("bert.embeddings.LayerNorm.weight", 0)],
             "bert.encoder.layer.{i}.", ["attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
                                         "output.LayerNorm.weight", "output.LayerNorm.bias"],
             ["cls.predictions.transform.LayerNorm.weight"]),
    "gpt2": ([("transformer.wte.weight", 1), ("transformer.wpe.weight", 1)],
             "transformer.h.{i}.", ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"],
             ["transformer.ln_f.weight", "transformer.ln_f.bias"]),
    "llama": ([("model.embed_tokens.weight", 1)], "model.layers.{i}.",
              ["input_layernorm.weight", "post_attention_layernorm.weight"], ["model.norm.weight"]),
    "vit": ([("vit.embeddings.patch_embeddings.projection.weight", 0), ("vit.embeddings.cls_token", 2),
             ("vit.embeddings.position_embeddings", 2)], "vit.layers.{i}.",
            ["layernorm_before.weight", "layernorm_before.bias", "layernorm_after.weight",
             "layernorm_after.bias"], ["vit.layernorm.weight"]),
}


RESIDUAL_KIND = {"bert": "perm", "gpt2": "perm", "llama": "orthogonal", "vit": "orthogonal_mean"}


@pytest.mark.parametrize("tiny", list(RESIDUAL), indirect=True)
def test_single_residual_stream_class(tiny):
    emb, prefix, norms, final = RESIDUAL[tiny.name]
    hidden = tiny.config.hidden_size
    res = [g for g in tiny.report.groups if set(emb) & slots(g)]
    g = one(res, "residual-stream class")
    # pre-norm models with an untied head fold their norm gains into the readers, and the
    # stream admits rotations (fixing 𝟙 under LayerNorm); tied GPT-2 and post-LN BERT cannot
    kind = RESIDUAL_KIND[tiny.name]
    assert g.kind == kind and g.size == hidden and g.blocks == 1
    gains = {prefix.format(i=i) + n for i in range(tiny.config.num_hidden_layers) for n in norms}
    gains |= set(final)
    folded = {n for f in tiny.report.folds for n in (f.gain, f.shift) if n and not f.keep_shift}
    if kind == "perm":
        assert folded == set()
        assert set(emb) | {(n, 0) for n in gains} <= slots(g), sorted(set(emb) - slots(g))
    else:  # every norm folds: gains (and shifts, into the readers' biases) leave the class
        assert {n for n in gains if n.endswith("weight")} <= folded
        assert set(emb) <= slots(g) and not {n for n, _ in slots(g)} & folded
    # no other group spans layers: each layer's own classes stay inside it
    l0, l1 = prefix.format(i=0), prefix.format(i=1)
    spanning = [h for h in tiny.report.groups if h is not g
                and any(p.startswith(l0) for p in names(h)) and any(p.startswith(l1) for p in names(h))]
    assert spanning == []


def test_tied_embedding_reported_once(gpt2, bert):
    for tiny, emb, head in ((gpt2, "transformer.wte.weight", "lm_head.weight"),
                            (bert, "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")):
        assert [head] in tiny.report.aliases.values()
        all_names = {p for g in tiny.report.groups for p in names(g)}
        assert emb in all_names and head not in all_names
        assert [g.kind for g in tiny.report.group_of(emb, 1)] == ["perm"]


def test_mlp_model_groups(mlp):
    w = mlp.info["widths"]
    kinds = {(g.kind, g.size): slots(g) for g in mlp.report.groups}
    assert kinds == {("scaled_perm", w[1]): {("0.weight", 0), ("0.bias", 0), ("2.weight", 1)},
                     ("perm", w[2]): {("2.weight", 0), ("2.bias", 0), ("4.weight", 1)}}


def test_transformer_encoder_groups(encoder):
    d, heads, ff = encoder.info["d"], encoder.info["heads"], encoder.info["ff"]
    for i in range(2):
        pre = f"layers.{i}."
        groups = in_layer(encoder.report.groups, pre)
        mlp = one([g for g in groups if g.kind in PERMUTATION_FAMILY and g.size == ff], "MLP perm")
        assert mlp.kind == "scaled_perm"  # ReLU
        hp = one([g for g in groups if g.kind == "perm" and g.size == heads], "head perm")
        inner = [g for g in groups if g.blocks == heads]
        assert inner and all(g.outer == [hp.id] and g.dim == d // heads for g in inner)
        assert (pre + "self_attn.out_proj.weight", 1) in hp.params
    # the residual stream is tied to the graph input (not transformable): no group of width d
    assert [g for g in encoder.report.groups if g.size == d and g.blocks == 1] == []


class _ScanIntoBuffer(torch.nn.Module):
    """RecurrentGemma's scan: each step written into a zeros buffer in place (``acc[:, t] = s``),
    then gated by another branch."""

    def __init__(self):
        super().__init__()
        self.x, self.y, self.out = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, h):
        x, y = self.x(h), torch.nn.functional.gelu(self.y(h))
        acc, state = torch.zeros_like(x), torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            acc[:, t] = state
        return self.out(acc * y)


def test_in_place_writes_are_read_as_values():
    """The exported graph writes into the buffer with ``copy_``; read without functionalising,
    the buffer looked constant and the gate's branch got a permutation of its own (RecurrentGemma
    certified at 0.63). Functionalised, the gate's branch is never a class of its own and the
    report certifies."""
    torch.manual_seed(0)
    m = _ScanIntoBuffer().eval()
    h = torch.randn(2, 5, 8)
    rep = symgraph.analyze(m, (h,))
    assert rep.certify(m, (h,), tol=1e-9) <= 1e-9
    owner = {(p[0], p[1]): g.id for g in rep.groups for p in g.params}
    assert owner.get(("y.weight", 0)) == owner.get(("x.weight", 0))  # never a class of the gate's branch alone
    assert owner.get(("y.weight", 0)) == owner.get(("out.weight", 1))

"""The report does not depend on the model's dtype (issue 40): every family of
``test_families.py`` and ``test_families_full_groups.py``, analysed in float32, bfloat16,
float16 and float64, has the same groups (kind, sizes, the slots they act on and how, their
rotary pairs, the groups they are fibred over), the same folds, frozen ops and fixed buffers.

Outside float32 the traced graph has casts float32 does not (``q.float()`` in ModernBERT's
``apply_rotary_pos_emb``, called twice, so the rotated operand is a second copy of ``q``):
the passes read through them. Real checkpoints are bf16 or fp16, and the out-of-core path
traces on ``meta`` in the checkpoint's dtype. Certificates run in float64, as everywhere.
"""
from __future__ import annotations

import copy
import functools
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.report.certify import cast_floats
from symgraph.testing import models

tf = pytest.importorskip("transformers")

import test_families as fam  # noqa: E402 - the families' builders and inputs
from test_families_full_groups import MORE  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --- a canonical, dtype-free description of a report --------------------------------------
def summary(report) -> dict:
    """What the report claims, with nothing that names graph nodes or union-find roots (group
    ids follow the roots, and the casts of other dtypes are extra nodes): each group by its
    kind, sizes, slots (with variance), buffers, rotary pairs and the groups it is fibred
    over (named by their slots)."""
    key = {g.id: tuple(sorted(zip(map(tuple, g.params), g.variance))) for g in report.groups}
    groups = sorted((g.kind, g.size, g.dim, g.blocks, key[g.id], tuple(sorted(map(tuple, g.buffers))),
                     g.pairs, tuple(sorted(key[o] for o in g.outer))) for g in report.groups)
    return {
        "groups": groups,
        "frozen": sorted((f.op, f.module) for f in report.frozen),
        "folds": sorted((f.gain, f.shift, tuple(map(tuple, f.readers)), f.keep_shift) for f in report.folds),
        "fixed_buffers": sorted(report.fixed_buffers),
        "shared": sorted(key[i] for i in report.shared),
        "stacked": sorted(report.stacked.items()),
        "parameters": sorted((n, report.param_shape(n)) for n in report.parameters),
    }


# --- the families: name -> () -> (model, inputs or None, analyze options) -----------------
def _swin():
    return fam.randomized(tf.SwinForImageClassification(fam.swin_config())), {"pixel_values": fam.pixels()}, {}


def _clip():
    return (fam.randomized(tf.CLIPModel(fam.clip_config())), {"input_ids": fam.ids(), "pixel_values": fam.pixels(16)},
            {"outputs": ["logits_per_image", "logits_per_text"]})


def _mamba2():
    return fam.randomized(tf.Mamba2ForCausalLM(fam.mamba2_config())), {"input_ids": fam.ids()}, {}


def _custom(cls):
    def build():
        torch.manual_seed(0)
        return cls().eval().double(), (torch.randn(2, 6, 5, dtype=torch.float64),), {}
    return build


def _row(model_type, cls):
    """A row of the coverage tables, built as the tool builds it (its shrunk config)."""
    def build():
        from benchmarks.coverage.shrink import build as shrunk
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return shrunk(model_type, cls)[0].eval(), None, {}
    return build


# rows of the coverage tables whose example inputs come from trial runs of the forward through
# mixture-of-experts blocks, and whose vision towers take values transformers precomputes
# (``passes.export_inputs``): Inkling's audio codes and patch clips; Inkling 2's and 2-loop's
# images; GLM-4.5V's and Qwen3-VL-MoE's towers. In float64 transformers' default ``grouped_mm``
# has no kernel, so every trial failed and Inkling's audio tower was left unread (16 groups in
# float32, 0 in float64) until the trials ran under the trace's experts implementation
# (``passes.experts``); in bfloat16 the check that the precomputed values change nothing held
# the outputs to float32's round-off, so nothing was handed over (GLM-4.5V froze its tower's
# ``repeat_interleave``, Qwen3-VL-MoE and Inkling 2 failed to trace)
ROWS = {"inkling_mm_model": ("inkling_mm_model", "InklingForConditionalGeneration"),
        "inkling2": ("inkling2", "Inkling2ForConditionalGeneration"),
        "inkling2_loop": ("inkling2_loop", "Inkling2LoopForConditionalGeneration"),
        "glm4v_moe": ("glm4v_moe", "Glm4vMoeForConditionalGeneration"),
        "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")}
_SAVED: dict = {}


def _loaded(name, dtype):
    """Row ``name`` saved and loaded in ``dtype`` as a checkpoint is: the modules its class keeps
    in float32 (``_keep_in_fp32_modules_strict``: Inkling 2's router, whose forward casts its
    input to float32) stay float32, which ``.to(dtype)`` would not keep."""
    if name not in _SAVED:
        _SAVED[name] = tempfile.TemporaryDirectory()
        _model(name)[0].save_pretrained(_SAVED[name].name)
    cls = getattr(tf, ROWS[name][1])
    return cls.from_pretrained(_SAVED[name].name, dtype=dtype, trust_remote_code=False).eval()

BUILDERS = {
    **{name: _row(*row) for name, row in ROWS.items()},
    "swin": _swin,
    "bart": lambda: (fam.bart(), {"input_ids": fam.ids()}, {"outputs": ["logits"]}),
    "clip": _clip,
    "fused_gqa": _custom(fam.FusedGQA),
    "dbrx": _custom(fam.DbrxStyle),
    "multihead_attention": _custom(fam.MHA),
    "mamba2": _mamba2,
    **{name: (lambda name=name: (models.build(name, seed=0), None, {})) for name in models.ARCHS},
    **{name: (lambda build=build: (build().eval(), None, {})) for name, build in MORE.items()},
}
# about 0.3 to 2 s per family and dtype: a representative fast subset (rotary packed QKV,
# rotary GQA, fused grouped QKV, packed in_proj); the rest is slow
FAST = {"modernbert", "llama", "fused_gqa", "multihead_attention"}
# BART in float16 has a data-dependent branch (``if hidden_states.dtype == torch.float16 and
# not torch.isfinite(hidden_states).all(): clamp``, in 37 transformers models): it is traced as
# the example takes it (passes.trace._export) and its report joins the comparison above
# (test_bart_float16_is_traced_through_its_branch below)


@functools.lru_cache(maxsize=None)
def _model(name):
    return BUILDERS[name]()


@functools.lru_cache(maxsize=None)
def report(name, dtype):
    """``name`` analysed in ``dtype`` (a copy of the model and its floating-point inputs cast)."""
    model, inputs, options = _model(name)
    model = _loaded(name, dtype) if name in ROWS else copy.deepcopy(model).to(dtype)
    return symgraph.analyze(model, cast_floats(inputs, dtype), **options)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in BUILDERS])
@pytest.mark.slow
def test_report_is_the_same_in_every_dtype(name):
    want = summary(report(name, torch.float32))
    assert want["groups"], name
    for dtype in DTYPES[1:]:
        got = summary(report(name, dtype))
        for part in want:
            assert got[part] == want[part], (name, dtype, part)
    if name in ROWS:  # each dtype's report certified as the coverage tool does (in float64)
        for dtype in DTYPES:
            assert report(name, dtype).certify(_model(name)[0]) <= 1e-6, (name, dtype)


@pytest.mark.slow
def test_bart_float16_is_traced_through_its_branch():
    """The clamp branch reads no parameter, so the report claims what float32's does (the
    comparison above) and no op is left without a rule."""
    from symgraph.passes.nodes import BRANCHES_TAKEN
    rep = report("bart", torch.float16)
    assert rep.exported_program.graph_module.meta[BRANCHES_TAKEN] is True
    assert rep.frozen == []
    assert summary(rep) == summary(report("bart", torch.float32))


# --- example inputs through mixture-of-experts blocks in every dtype ------------------------
def _shapes(kwargs):
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.slow
def test_inkling_inputs_and_report_in_float64():
    """Inkling's trial runs go through its experts in every dtype: the float64 model gets the
    float32 model's inputs (its audio codes among them), its experts implementation is left as
    it was, and its report claims the same 16 groups, certified in float64."""
    from symgraph.passes.inputs import default_inputs
    model = _model("inkling_mm_model")[0]  # (its router casts its own weight: ``.to`` runs)
    _, want = default_inputs(model)
    assert {"input_ids", "pixel_values", "audio_input_ids"} <= set(want)
    for dtype in (torch.float64, torch.bfloat16):
        m = copy.deepcopy(model).to(dtype)
        before = m.config.text_config._experts_implementation
        _, got = default_inputs(m)
        assert _shapes(got) == _shapes(want), dtype
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["audio_input_ids"],
                                                                                want["audio_input_ids"])
        assert got["pixel_values"].dtype == dtype
        assert m.config.text_config._experts_implementation == before == "grouped_mm"
    rep = report("inkling_mm_model", torch.float64)
    assert rep.unread is None and len(rep.groups) == 16
    assert sorted(g.kind for g in rep.groups) == ["gl"] * 2 + ["perm"] * 14
    assert summary(rep) == summary(report("inkling_mm_model", torch.float32))
    assert rep.certify(model) <= 1e-6
    assert report("inkling_mm_model", torch.bfloat16).certify(model) <= 1e-6


# --- ModernBERT: the rotary classes in bf16 ------------------------------------------------
def _attention(rep):
    return sorted((g.kind, g.size, g.dim, g.blocks) for g in rep.groups if ".attn" in g.module)


def test_modernbert_bf16_has_per_head_rope_and_vo_classes():
    """bf16 casts Q and K to float32 twice each (``q.float() * cos + rotate_half(q.float()) * sin``):
    the rotated copy is the same value, so each head keeps its RoPE class on QK and its GL
    class on VO (it had no RoPE class and one GL class across Q, K and V)."""
    per_layer = [("gl", 32, 8, 4), ("perm", 4, 4, 1), ("rope", 32, 8, 4)]
    for dtype in DTYPES:
        rep = report("modernbert", dtype)
        assert _attention(rep) == sorted(per_layer * 2), dtype
        assert rep.frozen == []
        for g in rep.groups:
            if g.kind == "rope":
                assert g.pairs == ((0, 4), (1, 5), (2, 6), (3, 7))
                assert {p for p, _ in g.params} == {g.module + ".weight"}  # Q and K rows of Wqkv
                heads = [h for h in rep.groups if h.id in g.outer]
                assert [(h.kind, h.size) for h in heads] == [("perm", 4)]
        # Q, K (rope) and V (gl) are different classes of the packed axis, per head
        for layer in range(2):
            wqkv = f"model.layers.{layer}.attn.Wqkv.weight"
            packed = rep.param_axes(wqkv)[0]
            assert rep.axis_structure(packed) == ("sum", [32, 32, 32])
            kinds = sorted(g.kind for g in rep.groups if (wqkv, 0) in g.params)
            assert kinds == ["gl", "perm", "rope"], (dtype, layer)
    model = _model("modernbert")[0]
    for dtype in (torch.bfloat16, torch.float16):  # certified in float64
        assert report("modernbert", dtype).certify(copy.deepcopy(model).double()) < 1e-9


def test_modernbert_on_meta_in_bf16():
    """The out-of-core path: shapes only, in the checkpoint's dtype."""
    with torch.device("meta"):
        model = MORE["modernbert"]().eval().to(torch.bfloat16)
    rep = symgraph.analyze(model)
    assert summary(rep) == summary(report("modernbert", torch.float32))


# --- the rotary pattern through casts, on a tiny module -----------------------------------
def _rotate_half(x):
    n = x.shape[-1] // 2
    return torch.cat((-x[..., n:], x[..., :n]), dim=-1)


class CastRope(nn.Module):
    """Q/K projections, RoPE computed in float32 with a separate cast of the operand on each
    side (the Hugging Face code), then attention in the model's dtype. ``other=True`` rotates
    the key where the query is meant: not a rotation of anything."""

    def __init__(self, d=16, h=2, other=False):
        super().__init__()
        self.h, self.hd, self.other = h, d // h, other
        self.emb, self.q, self.k, self.v, self.o = (nn.Linear(5, d), *(nn.Linear(d, d, bias=False) for _ in range(4)))
        self.head = nn.Linear(d, 3)
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, self.hd, 2).float() / self.hd)),
                             persistent=False)

    def forward(self, x):
        h = self.emb(x)
        B, T, _ = h.shape
        q, k, v = (f(h).view(B, T, self.h, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        ang = torch.arange(T, device=h.device).float()[:, None] * self.inv_freq.float()
        ang = torch.cat((ang, ang), -1)  # the tables are built pair-symmetric (checked on the graph)
        cos, sin = ang.cos().to(h.dtype), ang.sin().to(h.dtype)
        q2 = ((q.float() * cos) + (_rotate_half((k if self.other else q).float()) * sin)).to(h.dtype)
        k2 = ((k.float() * cos) + (_rotate_half(k.float()) * sin)).to(h.dtype)
        a = torch.softmax(q2 @ k2.transpose(-1, -2), -1) @ v
        return self.head(h + self.o(a.transpose(1, 2).reshape(B, T, -1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_through_casts(dtype):
    torch.manual_seed(0)
    m, x = CastRope().eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    rep = symgraph.analyze(copy.deepcopy(m).to(dtype), (x.to(dtype),))
    (rope,) = [g for g in rep.groups if g.kind == "rope"]
    assert (rope.dim, rope.blocks, rope.pairs) == (8, 2, ((0, 4), (1, 5), (2, 6), (3, 7)))
    assert {p for p, _ in rope.params} == {"q.weight", "k.weight"}
    assert rep.certify(m, (x,)) < 1e-6  # the rotation runs in float32 (.float()) in every dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_another_tensor_is_not_rope(dtype):
    """``q ⊙ cos + R(k) ⊙ sin``: the casts of q and k have different sources, so no RoPE
    class is claimed on the query side (soundness: a rotation of q's pairs does not commute)."""
    torch.manual_seed(0)
    m, x = CastRope(other=True).eval().double(), torch.randn(2, 6, 5, dtype=torch.float64)
    rep = symgraph.analyze(copy.deepcopy(m).to(dtype), (x.to(dtype),))
    assert not any(g.kind == "rope" and ("q.weight", 0) in g.params for g in rep.groups)
    assert rep.certify(m, (x,)) < 1e-6

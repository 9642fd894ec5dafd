"""A tensor a checkpoint does not store cannot move: reloading recomputes it in its first basis.

Marian's sinusoidal positions are parameters its ``save_pretrained`` leaves out
(``_keys_to_ignore_on_save``); Speech2Text's and M2M100's are non-persistent buffers. Both are
added to the residual stream, so a symmetry that moved them would give a model that computes
something else once saved and loaded again (and a merge of two checkpoints aligned its residual
streams against positions neither file holds). Falcon-H1's µP multipliers are non-persistent
too, but the same along their axis: permutations keep them, so its classes stay, on a real
model and on ``meta`` alike (their values as its class computes them)."""
from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.testing.models import randomized

SEQ2SEQ = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32,
               pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0)


def marian():
    """Its weights drawn, its positions as loading computes them (they are parameters, so
    ``randomized`` drew them too)."""
    with tempfile.TemporaryDirectory() as d:
        randomized(tf.MarianMTModel(tf.MarianConfig(**SEQ2SEQ))).save_pretrained(d)
        return tf.MarianMTModel.from_pretrained(d, dtype=torch.float64).eval()


def m2m_100():
    return randomized(tf.M2M100ForConditionalGeneration(tf.M2M100Config(**SEQ2SEQ)).eval())


def speech_to_text():
    cfg = tf.Speech2TextConfig(**{**SEQ2SEQ, "max_source_positions": 32, "max_target_positions": 32},
                               input_feat_per_channel=8, input_channels=1, num_conv_layers=1, conv_channels=16,
                               conv_kernel_sizes=[5])
    return randomized(tf.Speech2TextForConditionalGeneration(cfg).eval())


def inputs(model):
    g = torch.Generator().manual_seed(1)
    dec = torch.randint(3, 64, (2, 5), generator=g)
    if isinstance(model, tf.Speech2TextForConditionalGeneration):
        return dict(input_features=torch.randn(2, 12, 8, generator=g, dtype=torch.float64), decoder_input_ids=dec)
    return dict(input_ids=torch.randint(3, 64, (2, 6), generator=g), decoder_input_ids=dec)


@pytest.mark.parametrize("build, unsaved, why", [
    (marian, "model.encoder.embed_positions.weight", "_keys_to_ignore_on_save"),
    (m2m_100, "model.encoder.embed_positions.weights", "a non-persistent buffer"),
    (speech_to_text, "model.decoder.embed_positions.weights", "a non-persistent buffer")])
def test_moved_saved_and_loaded_computes_the_same(tmp_path, build, unsaved, why):
    model = build()
    report = symgraph.analyze(model, inputs(model))
    assert report.certify(model, inputs(model)) < 1e-10
    if why == "_keys_to_ignore_on_save":  # a parameter: its axes fixed, saying why
        assert all(report.axis_fixed(a) for a in report.param_axes(unsaved))
        assert any(why in text for c in report.axis_reasons(unsaved, 1) for _, text in c["reasons"])
    else:
        assert why in report.fixed_buffers[unsaved]
    assert unsaved not in report.buffers
    moved = symgraph.transform(model, report.random_transform(seed=2, orthogonal=True))
    assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), moved.parameters())) > 0.1
    moved.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        want, got = model(**inputs(model)).logits, loaded(**inputs(model)).logits
    assert float((want - got).abs().max() / want.abs().max()) < 1e-10


@pytest.mark.slow
def test_merge_of_marian_and_its_moved_copy_is_marian(tmp_path):
    """The command line's merge of a checkpoint with a moved copy of it gives it back."""
    model = marian()
    report = symgraph.analyze(model, inputs(model))
    model.save_pretrained(tmp_path / "a")
    symgraph.transform(model, report.random_transform(seed=3, orthogonal=True)).save_pretrained(tmp_path / "b")
    run = subprocess.run([sys.executable, "-m", "symgraph", "merge", str(tmp_path / "a"), str(tmp_path / "b"),
                          "--out", str(tmp_path / "c")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    merged = tf.MarianMTModel.from_pretrained(tmp_path / "c", dtype=torch.float64).eval()
    with torch.no_grad():
        want, got = model(**inputs(model)).logits, merged(**inputs(model)).logits
    assert float((want - got).abs().max() / want.abs().max()) < 1e-10


@pytest.mark.slow
def test_uniform_unsaved_buffer_keeps_its_classes_on_meta_too(tmp_path):
    cfg = tf.FalconH1Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32,
                            mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4, mamba_n_groups=1, mamba_chunk_size=8,
                            max_position_embeddings=32)
    model = randomized(tf.FalconH1ForCausalLM(cfg).eval(), dtype=torch.float32)
    report = symgraph.analyze(model)
    mup = "model.layers.0.mamba.mup_vector"
    assert "non-persistent" in report.fixed_buffers[mup]
    model.save_pretrained(tmp_path)
    on_meta = symgraph.analyze(Checkpoint(str(tmp_path)).model)
    assert sorted((g.kind, g.dim) for g in on_meta.groups) == sorted((g.kind, g.dim) for g in report.groups)
    assert sum(g.dim for g in report.groups if g.kind == "perm") >= 32  # the Mamba heads and channels stay
    assert report.certify(model.double()) < 1e-10

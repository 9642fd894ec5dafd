"""A user's check of the whole path: a ``save_pretrained`` checkpoint, a copy of it moved by a
random element of its report, ``symgraph merge`` of the two by the command line's entry, the
merge loaded back by transformers. Merging a model with an aligned copy of itself gives it back,
so the merge must compute what the model does (its kept outputs, float64). This found Marian's
unsaved positions moving with the stream (67 % off, exit 0; its case and M2M100's are in
``test_unsaved_tensors.py``), Mamba-2's default config refused, and Wav2Vec2's stream (two classes
on one axis, ``test_product_pairs.py``) not recovered: 64 % off."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.app.config import build_config
from symgraph.app.run import run_merge
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

pytestmark = pytest.mark.slow


def t5():
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def whisper():
    return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))


def wav2vec2():
    return tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, pad_token_id=0))


def mamba2():
    return tf.Mamba2ForCausalLM(tf.Mamba2Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=4, head_dim=8, state_size=4, n_groups=1,
        expand=2, chunk_size=8))


@pytest.mark.parametrize("build", [t5, whisper, mamba2, wav2vec2])
def test_merge_of_a_checkpoint_and_its_moved_copy_is_the_checkpoint(tmp_path, build):
    model = randomized(build())  # float64, eval
    args, kwargs = default_inputs(model)
    report = symgraph.analyze(model, kwargs or args)
    moved = symgraph.transform(model, report.random_transform(seed=1, orthogonal=True))

    def kept(m):
        with torch.no_grad():
            out = m(*args, **kwargs)
        return [out[k] for k in (report.outputs or ("logits",))]
    want = kept(model)
    assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), moved.parameters())) > 0.1
    assert max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, kept(moved))) < 1e-6
    model.save_pretrained(tmp_path / "a")
    moved.save_pretrained(tmp_path / "b")
    run_merge(build_config(dict(models=[str(tmp_path / "a"), str(tmp_path / "b")], out=str(tmp_path / "c"))),
              progress=False)
    merged = type(model).from_pretrained(tmp_path / "c", dtype=torch.float64).eval()
    assert next(merged.parameters()).dtype == torch.float64
    assert max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, kept(merged))) < 1e-9

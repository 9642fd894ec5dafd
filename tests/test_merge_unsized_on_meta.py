"""A checkpoint whose traced program has a size or a branch only its data decide (T5's classifier
picks each row's last end-of-sequence token with ``unique_consecutive``; Switch Transformers runs
the experts its router picked) cannot be analysed on ``meta``, where the out-of-core merge reads
it: the merge loads the models instead (found by the coverage round trip,
``benchmarks/coverage/roundtrip.py``, whose merges of these checkpoints with moved copies of
themselves were refused). Nor can a vision-language model whose image features only values count
(Idefics3, whose merge came back silently unaligned)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import symgraph
from symgraph.app.config import build_config
from symgraph.app.run import run_merge
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.errors import NeedsMemory, TraceError, UnsizedOnMeta
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

pytestmark = pytest.mark.slow


def t5_classifier():
    return randomized(tf.T5ForSequenceClassification(tf.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, num_labels=3)))


def test_unsized_on_meta_is_a_trace_error_that_needs_memory(tmp_path):
    t5_classifier().save_pretrained(tmp_path)
    with pytest.raises(UnsizedOnMeta, match="unique_consecutive .* depends on the data") as e:
        symgraph.analyze(Checkpoint(str(tmp_path)).model)
    assert isinstance(e.value, TraceError) and isinstance(e.value, NeedsMemory)


def switch_transformers():
    """Its router's experts are run in a loop over those the data picked: a branch on data."""
    return randomized(tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=24, expert_capacity=8, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=2, num_experts=2, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)))


def idefics3():
    """Its tower keeps the images that are not padding, a selection only the pixels decide: on meta
    no image's features can be counted (text alone left every class fixed and the merge averaged
    the two checkpoints unaligned, 1.18 off with exit 0)."""
    from analyze_helpers import coverage_row
    return randomized(coverage_row("idefics3", "Idefics3ForConditionalGeneration"))


@pytest.mark.parametrize("build", [t5_classifier, switch_transformers, idefics3])
def test_merge_of_a_checkpoint_and_its_moved_copy_loads_what_meta_cannot_trace(tmp_path, build):
    model = build()
    model.save_pretrained(tmp_path / "a")
    with pytest.raises(UnsizedOnMeta):
        symgraph.analyze(Checkpoint(str(tmp_path / "a")).model)
    args, kwargs = default_inputs(model)
    report = symgraph.analyze(model)
    moved = symgraph.transform(model, report.random_transform(seed=1, orthogonal=True))
    assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), moved.parameters())) > 0.1
    moved.save_pretrained(tmp_path / "b")
    out = run_merge(build_config(dict(models=[str(tmp_path / "a"), str(tmp_path / "b")], out=str(tmp_path / "c"))),
                    progress=False)
    assert out.mode == "in-memory"
    merged = type(model).from_pretrained(tmp_path / "c", dtype=torch.float64).eval()
    with torch.no_grad():
        want, got = model(*args, **kwargs).logits, merged(*args, **kwargs).logits
    assert float((want - got).abs().max() / want.abs().max()) < 1e-9

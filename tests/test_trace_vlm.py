"""Issue 65: a vision-language model whose vision tower packs its images into one sequence
(GLM-4V) computes its attention segments and patch positions from the images' grid with loops
and a ``cumsum`` no trace follows; ``symgraph.analyze(model)`` traces it with those values
precomputed by transformers' own export support, handed to the tower's call while tracing."""
from __future__ import annotations

import pytest
import torch

from symgraph.passes import export_inputs
from symgraph.passes.inputs import default_inputs
from symgraph.passes.trace import flatten_outputs, trace
from symgraph.testing.models import randomized
from analyze_helpers import certified_mlp

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.exporters.utils")


def _glm4v():
    cfg = transformers.Glm4vConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=dict(rope_theta=10000.0, rope_type="default", mrope_section=[2, 1, 1])),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=24, num_heads=4, patch_size=4,
                           image_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32),
        image_token_id=60, video_token_id=61, image_start_token_id=56, image_end_token_id=57,
        video_start_token_id=58, video_end_token_id=59)
    torch.manual_seed(0)
    return randomized(transformers.Glm4vForConditionalGeneration(cfg).eval())


@pytest.mark.slow
def test_packed_vision_tower_traces_with_precomputed_segments():
    m = _glm4v()
    args, kwargs = default_inputs(m)
    assert "image_grid_thw" in kwargs and (kwargs["input_ids"] == 60).any()
    # the vision tower's own call is handed cu_seqlens and its patches' positions, nothing else
    with export_inputs.precomputed_inputs(m, args, kwargs, flatten_outputs) as handed:
        assert handed
    ep, _, _ = trace(m)
    consts = [v for v in ep.constants.values() if isinstance(v, torch.Tensor) and v.dtype == torch.int32]
    grid = kwargs["image_grid_thw"]
    patches = int((grid[:, 1] * grid[:, 2]).sum())
    # cu_seqlens (0, h·w, 2·h·w, ...) entered the program as a constant, not computed in it
    assert any(c.dim() == 1 and int(c[0]) == 0 and int(c[-1]) == patches for c in consts)


@pytest.mark.slow
def test_analyze_without_inputs_claims_the_vision_tower():
    m = _glm4v()
    r = certified_mlp(m, "model.visual.blocks.0.mlp.gate_proj.weight", "model.visual.blocks.0.mlp.down_proj.weight", 32)
    # the attention's heads and head widths, at the output projection's input
    heads = r.group_of("model.visual.blocks.0.attn.proj.weight", 1)
    assert len(heads) >= 1 and all(g.kind != "identity" for g in heads)


def test_a_forward_that_fails_eagerly_hands_nothing_over():
    m = _glm4v()
    args, kwargs = default_inputs(m)
    kwargs = {**kwargs, "image_grid_thw": kwargs["image_grid_thw"] * 2}  # more patches than pixels
    with export_inputs.precomputed_inputs(m, args, kwargs, flatten_outputs) as handed:
        assert not handed

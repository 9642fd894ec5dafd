"""An eager failure counts as transformers' only when the class on its family's own default
config, at full size, fails its forward with the same exception at the same line (issue 65);
a detector's example images take its backbone's configured size."""
from __future__ import annotations

import pytest
import torch
from packaging import version

from benchmarks.coverage.at_default import fails_eager_at_default, model_line, refusal
from benchmarks.coverage.family import transformers_fails
from benchmarks.coverage.shrink import build
from symgraph.passes.inputs import default_inputs

T = pytest.importorskip("transformers")


def _eager_error(model_type, class_name):
    model, _ = build(model_type, class_name)
    args, kwargs = default_inputs(model)
    with torch.no_grad():
        try:
            model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the row's failure
            return model, kwargs, e
    raise AssertionError("ran")


def test_a_default_config_that_fails_its_own_forward_is_transformers():
    # PP-OCRv6's default backbone returns one stage (out_indices [4]) to a neck built for four
    _, _, e = _eager_error("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection")
    assert isinstance(e, RuntimeError) and "expected input" in str(e)
    assert fails_eager_at_default("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection") == \
        "RuntimeError at modeling_pp_ocrv6_small_det.py:217"
    assert transformers_fails("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection", "eager", e)


def test_an_eager_failure_the_default_does_not_repeat_is_ours():
    assert fails_eager_at_default("resnet", "ResNetForImageClassification") is None  # it runs
    try:
        raise RuntimeError("ours")
    except RuntimeError as e:  # raised here: not the line the default fails at
        assert not transformers_fails("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection", "eager", e)
    assert not transformers_fails("resnet", "ResNetForImageClassification", "eager", ValueError("x"))


@pytest.mark.slow
def test_a_default_too_large_to_run_runs_under_fake_tensors():
    # the same verdict without data (a fake run); Llama 4's 108 B-parameter default (which could
    # not be allocated here) is run under fake tensors: before transformers 5.25 it failed where
    # its forward read ``image_outputs`` off its language model's output, which had none; 5.25
    # fixed that, and the fake run says it runs
    assert fails_eager_at_default("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection", most=1000) == \
        "RuntimeError at modeling_pp_ocrv6_small_det.py:217"
    verdict = fails_eager_at_default("llama4", "Llama4ForConditionalGeneration")
    if version.parse(T.__version__) >= version.parse("5.25"):
        assert verdict is None
        return
    assert verdict == "AttributeError at modeling_llama4.py:1318"
    _, _, e = _eager_error("llama4", "Llama4ForConditionalGeneration")
    assert isinstance(e, AttributeError) and "image_outputs" in str(e)
    assert transformers_fails("llama4", "Llama4ForConditionalGeneration", "eager", e)


def test_detector_images_take_the_backbones_size():
    """LW-DETR's ViT backbone tiles its image's patches into ``num_windows`` windows: 224-pixel
    images (14 × 14 patches) cannot be tiled 4 × 4; the backbone's own 64 pixels can. The row
    then fails where transformers' default config does: no feature levels to concatenate
    (``projector_scale_factors`` is empty by default)."""
    model, kwargs, e = _eager_error("lw_detr", "LwDetrForObjectDetection")
    side = model.config.backbone_config.image_size
    assert side == 64 and kwargs["pixel_values"].shape == (2, 3, side, side)
    assert isinstance(e, ValueError) and "non-empty list" in str(e)
    assert model.config.projector_scale_factors == ()
    assert transformers_fails("lw_detr", "LwDetrForObjectDetection", "eager", e)


def test_a_refusal_transformers_raises_itself_is_never_cleared(monkeypatch):
    """Gemma 4's assistant refuses to run without the target model's states, at every size: on
    token ids alone its default config failed at the same ``raise`` (so the row was cleared
    while the inputs were ours); such a refusal clears nothing. Its inputs now carry the
    states, and it runs."""
    import benchmarks.coverage.at_default as at_default
    model, _ = build("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM")
    with torch.no_grad():
        try:
            model(input_ids=torch.zeros(2, 8, dtype=torch.long))
        except ValueError as e:
            err = e
    assert refusal(err) and "cannot be None" in str(err)
    assert not refusal(_eager_error("pp_ocrv6_small_det", "PPOCRV6SmallDetForObjectDetection")[2])
    monkeypatch.setattr(at_default, "fails_eager_at_default", lambda *a: f"ValueError at {model_line(err)}")
    assert not transformers_fails("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM", "eager", err)
    _, kw = default_inputs(model)  # the states and embeddings it takes: it runs
    assert set(kw["shared_kv_states"]) == {"sliding_attention", "full_attention"}
    with torch.no_grad():
        assert model(**kw).logits.shape == (2, 8, model.config.get_text_config().vocab_size)

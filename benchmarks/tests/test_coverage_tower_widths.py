"""The shrink rule keeps a width one sub-config hands another equal to the receiver's width
(issue 65, ``derived.tower_widths``): transformers' default composites of Qwen3-ASR and
Qwen3-Omni state an audio ``output_dim`` (3584) that is not their text width (2048), and
Granite Speech a Q-Former ``encoder_hidden_size`` (1408) that is not its encoder's width
(1024); a real checkpoint states them equal and the models' code needs them equal."""
from __future__ import annotations

import pytest

from benchmarks.coverage.shrink import tiny_config

T = pytest.importorskip("transformers")


def test_default_composites_are_inconsistent_where_the_rule_acts():
    """What the rule corrects is transformers' defaults, not a shrink artefact."""
    asr = T.Qwen3ASRConfig()
    assert asr.audio_config.output_dim == 3584 != asr.text_config.hidden_size == 2048
    gs = T.GraniteSpeechConfig()
    assert gs.projector_config.encoder_hidden_size == 1408 != gs.encoder_config.hidden_dim == 1024


def test_an_audio_tower_writes_the_text_width():
    cfg, _ = tiny_config("qwen3_asr")
    assert cfg.audio_config.output_dim == cfg.text_config.hidden_size == 64
    thinker = tiny_config("qwen3_omni_moe_thinker")[0]
    assert thinker.audio_config.output_dim == thinker.vision_config.out_hidden_size == thinker.text_config.hidden_size


def test_a_projector_reads_its_encoder_width_and_a_small_head_is_left_alone():
    cfg, _ = tiny_config("granite_speech")
    assert cfg.projector_config.encoder_hidden_size == cfg.encoder_config.hidden_dim == 64
    # the encoder's output_dim (42 CTC classes at default) is smaller than the text width:
    # a head of its own, not the text stream's width
    assert cfg.encoder_config.output_dim != cfg.text_config.hidden_size

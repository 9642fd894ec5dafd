"""The shrink rule's vision-tower consistency (issue 65, ``benchmarks.coverage.consistent``):
transformers' default composites state a vision tower's output width apart from the text's
(Qwen3-VL, GLM-5-Next), a rotary tower's width is scaled by another width of its level
(Qwen2-VL's ``embed_dim`` beside ``hidden_size``) into heads its 2-D rotary cannot fill, and
MiniCPM-V leaves its image token to the tokenizer: each leaves the shrunk model's vision tower
unread by any example input."""
from __future__ import annotations

import pytest

from benchmarks.coverage.shrink import role, tiny_config
from benchmarks.coverage.derived import handed_channels, layer_ids, placeholder_tokens, rotary_widths, stream_widths

T = pytest.importorskip("transformers")


def test_default_composites_are_inconsistent_where_the_rules_act():
    q3 = T.Qwen3VLConfig()
    assert q3.vision_config.out_hidden_size == 3584 != q3.text_config.hidden_size == 4096
    q2 = T.Qwen2VLConfig().vision_config
    assert (q2.hidden_size, q2.embed_dim, q2.num_heads) == (3584, 1280, 16)
    assert T.MiniCPMV4_6Config().image_token_id is None


@pytest.mark.parametrize("family", ["qwen3_vl", "cosmos3_omni", "glm5_next"])
def test_a_vision_tower_writes_the_text_width(family):
    cfg, _ = tiny_config(family)
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size == 64


def test_a_rotary_towers_heads_keep_a_whole_head_width():
    vision = tiny_config("qwen2_vl")[0].vision_config
    assert vision.embed_dim == 64 and vision.num_heads == 4   # 16 per head, 4 per rotary axis
    assert vision.hidden_size == 64                            # the width it hands the text


def test_image_tokens_are_free_ids_of_the_vocabulary():
    for family in ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr"):
        cfg, over = tiny_config(family)
        vocab = cfg.text_config.vocab_size
        assert (over["image_token_id"], over["video_token_id"]) == (vocab - 1, vocab - 2)
    # ids another token takes are skipped; a stated one is kept
    fields = {"vision_config": object(), "image_token_id": None, "video_token_id": None, "pad_token_id": 255}
    assert placeholder_tokens(fields, {}, 256) == {"image_token_id": 254, "video_token_id": 253}
    assert placeholder_tokens({**fields, "image_token_id": 7}, {}, 256) == {"video_token_id": 254}
    assert placeholder_tokens({"image_token_id": None}, {}, 256) == {}  # no vision tower: no image


def test_channels_handed_to_another_tower_end_in_its_width():
    assert list(T.UnlimitedOcrConfig().vision_config.sam_config.downsample_channels) == [512, 1024]
    vision = tiny_config("unlimited_ocr")[0].vision_config
    assert list(vision.sam_config.downsample_channels) == [32, 64] and vision.encoder_config.hidden_size == 64
    # a list that ends in no other tower's width is left alone
    sam, enc = T.UnlimitedOcrConfig().vision_config.sam_config, T.UnlimitedOcrConfig().vision_config.encoder_config
    out = {"sam_config": {"hidden_size": 64, "downsample_channels": [512, 1000]}, "encoder_config": {"hidden_size": 64}}
    assert handed_channels({"sam_config": sam, "encoder_config": enc}, out, ("hidden_size",)) == {}


def test_a_merger_after_a_layer_past_the_stack_moves_into_it():
    assert T.MiniCPMV4_6Config().insert_layer_id == T.MiniCPMV4_6Config().vision_config.insert_layer_id == 6
    for family in ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr"):
        cfg, over = tiny_config(family)
        layers = cfg.vision_config.num_hidden_layers
        # the composite hands its own index to the vision config: both name a layer of the stack
        assert over["insert_layer_id"] == cfg.vision_config.insert_layer_id == layers - 1 == 1
    fields = {"num_hidden_layers": 12, "insert_layer_id": 6, "first_layer_id": 0}
    assert layer_ids(fields, {"num_hidden_layers": 2}, role) == {"insert_layer_id": 1}
    assert layer_ids({**fields, "insert_layer_id": 1}, {"num_hidden_layers": 2}, role) == {}  # within it


def test_rules_leave_other_widths_alone():
    # no rotary parameters: a second width is not a width of heads (ALBERT's embedding)
    assert rotary_widths({"hidden_size": 4096, "embedding_size": 128, "num_attention_heads": 64},
                         {}, ("hidden_size", "embedding_size"), 4, 16) == {}
    # a head count that makes heads narrower than a head width: left alone
    fields = {"hidden_size": 3584, "embed_dim": 48, "num_heads": 16, "rope_parameters": {"rope_type": "axial"}}
    assert rotary_widths(fields, {}, ("hidden_size", "embed_dim"), 4, 16) == {}
    assert rotary_widths({**fields, "embed_dim": 1280}, {}, ("hidden_size", "embed_dim"), 4, 16) == {"embed_dim": 64}
    # an output narrower than the tower's own width is a head of its own, not the text stream
    text, vision = T.Qwen3VLConfig().text_config, T.Qwen3VLConfig().vision_config
    vision.out_hidden_size = 42
    out = {"text_config": {"hidden_size": 64}, "vision_config": {"hidden_size": 64, "out_hidden_size": 8}}
    assert stream_widths({"text_config": text, "vision_config": vision}, out, ("hidden_size",)) == {}

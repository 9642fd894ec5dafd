"""Issue 65, vision-language rows (``image_text_to_text``): a model that states no image tokens
per image gets as many as its own ``get_image_features`` returns (LLaVA), so its vision tower is
read and aligned; the shrink rule keeps Gemma 3's tokens per image a square within the shrunk
image's patches (256 tokens from 4×4 patches pooled with a kernel of 0: "stride should not be
zero"); a slice whose bounds the program computes (Mistral 3's per-image features) fixes the
sliced axis instead of failing the analysis."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from benchmarks import coverage as cov
from benchmarks.coverage.family import run_eagerly
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")


def _llava():
    cfg = transformers.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=20,
                           num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4),
        image_token_index=60, vision_feature_layer=-1)
    return randomized(transformers.LlavaForConditionalGeneration(cfg))


def test_image_tokens_counted_by_the_models_own_features():
    m = _llava()
    assert getattr(m.config, "image_seq_length", None) in (None, 576)  # the config's is not these images'
    _, kw = default_inputs(m)
    ids = kw["input_ids"]
    # (16/4)² patches, the class token dropped by the default feature strategy: 16 per image
    assert kw["pixel_values"].shape == (2, 3, 16, 16) and (ids == 60).sum(1).tolist() == [16, 16]
    assert ids[:, 0].ne(60).all() and ids[:, -1].ne(60).all() and ids.shape[1] == 1 + 16 + 1  # text around it
    r = symgraph.analyze(m)
    assert r.certify(m) < 1e-6
    # the vision tower is read: its MLP's hidden units are a permutation class
    fc = r.group_of("model.vision_tower.encoder.layers.0.mlp.fc1.weight", 0)
    assert [g.kind for g in fc] == ["perm"] and fc[0].size == 20
    assert ("model.vision_tower.encoder.layers.0.mlp.fc2.weight", 1) in fc[0].params


def test_gemma3_tokens_per_image_fit_the_shrunk_image():
    cfg, over = cov.tiny_config("gemma3")
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    assert cfg.vision_config.image_size == cov.IMAGE and over["mm_tokens_per_image"] == side * side == 16
    model, _ = cov.build("gemma3", "Gemma3ForConditionalGeneration")
    args, kw = default_inputs(model)
    assert (kw["input_ids"] == cfg.image_token_id).sum(1).tolist() == [16, 16]
    run_eagerly(model, args, kw)  # transformers runs it: pooled with a kernel of 1


class Cut(nn.Module):
    """A hidden layer, and a slice of another projection up to a count read from the input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 12), nn.Linear(12, 4), nn.Linear(4, 4)

    def forward(self, x, n):
        h = self.a(x)
        k = n.sum().item()
        torch._check(k >= 1)
        torch._check(k <= 12)
        return self.c(torch.relu(self.b(h))) + h[:, :k].sum(-1, keepdim=True)


def test_slice_with_bounds_computed_in_the_program_fixes_its_axis():
    m = Cut().double()
    inputs = (torch.randn(3, 8, dtype=torch.float64), torch.tensor([2, 3]))
    r = symgraph.analyze(m, inputs=inputs)
    assert r.group_of("a.weight", 0) == []  # the cut axis: which entries are kept is unknown
    (hidden,) = r.group_of("b.weight", 0)
    assert hidden.kind == "scaled_perm" and hidden.size == 4 and ("c.weight", 1) in hidden.params
    assert r.certify(m, inputs=inputs) < 1e-6


def test_a_decoder_alone_reads_its_cross_attention():
    # BART's causal LM holds cross-attention that reads encoder states only when given them;
    # left unread, every class would be fixed. BERT as a decoder without cross-attention refuses
    # them, and gets none.
    bart = randomized(transformers.BartForCausalLM(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=20, max_position_embeddings=32)))
    _, kw = default_inputs(bart)
    assert kw["encoder_hidden_states"].shape == (2, 4, 16)
    r = symgraph.analyze(bart)
    assert r.certify(bart) < 1e-6
    k = "model.decoder.layers.0.encoder_attn.k_proj.weight"
    assert any(g.kind == "perm" and g.size == 4 for g in r.group_of(k, 0))  # its heads
    (mlp,) = r.group_of("model.decoder.layers.0.fc1.weight", 0)
    assert mlp.kind == "perm" and mlp.size == 20
    bert = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
        is_decoder=True))
    assert "encoder_hidden_states" not in default_inputs(bert)[1]


def _tower_read(model_type, class_name, fc1, size):
    """``model_type``'s tiny coverage model analysed with no inputs: sound, and the vision
    tower's first MLP (``fc1``'s output, ``size`` units) a permutation class."""
    model, _ = cov.build(model_type, class_name)
    r = symgraph.analyze(model)
    assert r.certify(model) < 1e-6
    groups = r.group_of(fc1, 0)
    assert [(g.kind, g.size) for g in groups] == [("perm", size)]
    return model, r


def test_grid_of_patches_from_the_qwen_vl_processor():
    # LFM3-VL takes a grid (image_grid_thw) of flattened patches, made by the Qwen2-VL image
    # processor transformers maps it to, sized to the shrunk vision config: 4 × 4 patches merged
    # 2 × 2 -> 4 image tokens a row; its video tower is its image tower: no video. (Its trace
    # stops at the vision attention's cumulative lengths: torch's real-tensor propagation of
    # cumsum, a limit of the trace, not of these inputs.)
    model, _ = cov.build("lfm3_vl", "Lfm3VlForConditionalGeneration")
    _, kw = default_inputs(model)
    assert kw["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 and "pixel_values_videos" not in kw
    assert kw["pixel_values"].shape == (2 * 16, 3 * 2 * 16 * 16)  # C·T·P·P values a patch
    assert (kw["input_ids"] == model.config.image_token_id).sum(1).tolist() == [4, 4]
    run_eagerly(model, (), kw)


def test_base_models_image_features_count_the_tokens():
    # DeepSeek-VL's get_image_features is on its base model only
    model, _ = cov.build("deepseek_vl", "DeepseekVLForConditionalGeneration")
    assert getattr(model, "get_image_features", None) is None
    _, kw = default_inputs(model)
    assert (kw["input_ids"] == model.config.image_token_id).sum(1).tolist() == [16, 16]  # (64/16)² patches
    _tower_read("deepseek_vl", "DeepseekVLForConditionalGeneration",
                "model.vision_model.encoder.layers.0.mlp.fc1.weight", model.config.vision_config.intermediate_size)


def test_tiles_without_a_processor_and_an_encoders_vision_config():
    # ModernVBERT (no image processor in transformers' mapping) takes Idefics-style tiles
    # because its forward takes pixel_attention_mask; T5Gemma 2's vision config is its encoder's
    model, _ = cov.build("modernvbert", "ModernVBertForMaskedLM")
    _, kw = default_inputs(model)
    assert kw["pixel_values"].shape == (2, 1, 3, 64, 64) and kw["pixel_attention_mask"].all()
    assert (kw["input_ids"] == model.config.image_token_id).sum(1).tolist() == [1, 1]
    run_eagerly(model, (), kw)
    t5, _ = cov.build("t5gemma2", "T5Gemma2ForConditionalGeneration")
    assert getattr(t5.config, "vision_config", None) is None
    _, kw = default_inputs(t5)
    assert kw["pixel_values"].shape == (2, 3, 64, 64)
    assert (kw["input_ids"] == t5.config.encoder.image_token_id).sum(1).tolist() == [16, 16]
    run_eagerly(t5, (), kw)


def test_patches_as_rows_fuyu_and_naflex():
    # Fuyu (no vision config) embeds rows of patches by one linear map; LFM2-VL's SigLIP 2
    # (NaFlex) takes them with their grid and a mask of real patches
    fuyu, _ = cov.build("fuyu", "FuyuForCausalLM")
    _, kw = default_inputs(fuyu)
    p = fuyu.config.patch_size
    assert kw["pixel_values"].shape == (2, 4, 3 * p * p)  # a 64-pixel image: 2 × 2 patches of 30
    assert (kw["input_ids"] == fuyu.config.image_token_id).sum(1).tolist() == [4, 4]
    r = symgraph.analyze(fuyu)
    assert r.certify(fuyu) < 1e-6
    assert r.group_of("model.vision_embed_tokens.weight", 0)  # the patch embedding is claimed
    lfm, _ = cov.build("lfm2_vl", "Lfm2VlForConditionalGeneration")
    _, kw = default_inputs(lfm)
    assert kw["spatial_shapes"].tolist() == [[2, 2]] * 2 and kw["pixel_attention_mask"].all()
    run_eagerly(lfm, (), kw)


def test_a_video_tower_the_images_leave_unread_gets_a_video():
    # Video-LLaVA's videos go through a tower of their own: one video of two frames a row and
    # as many video tokens as get_video_features returns (two frames of 16 patches and a class
    # token each), after the image's 16 tokens
    model, _ = cov.build("video_llava", "VideoLlavaForConditionalGeneration")
    _, kw = default_inputs(model)
    ids = kw["input_ids"]
    assert kw["pixel_values_videos"].shape == (2, 2, 3, 64, 64)
    assert (ids == model.config.video_token_id).sum(1).tolist() == [34, 34]
    assert (ids == model.config.image_token_id).sum(1).tolist() == [16, 16]
    run_eagerly(model, (), kw)


def test_modality_of_each_token_where_the_forward_takes_it():
    # Cosmos 3's multimodal RoPE reads each token's modality (mm_token_type_ids: 1 an image
    # token, 0 text), as transformers' processors mark it; without it the forward refuses images
    model, _ = cov.build("cosmos3_edge", "Cosmos3EdgeForConditionalGeneration")
    _, kw = default_inputs(model)
    image = kw["input_ids"] == model.config.image_token_id
    assert image.sum() > 0 and torch.equal(kw["mm_token_type_ids"], image.int())
    run_eagerly(model, (), kw)


def test_multimodal_rope_positions_are_the_models_own():
    # GLM-4V's multimodal RoPE positions come from a Python loop over each token's modality,
    # which no trace can follow: the inputs carry them, computed by the model's own
    # compute_3d_position_ids, so the forward's output is what it computes without them
    model, _ = cov.build("glm4v", "Glm4vForConditionalGeneration")
    _, kw = default_inputs(model)
    assert kw["position_ids"].shape == (3, *kw["input_ids"].shape)
    given = {k: v for k, v in kw.items() if k != "position_ids"}
    with torch.no_grad():
        ours, theirs = model(**kw).logits, model(**given).logits
    assert torch.equal(ours, theirs)

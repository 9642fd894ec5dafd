"""Issue 65, optional inputs that read parameters the main input alone leaves unread (a parameter
the traced program never reads fixes every class): DINOv2's mask token (``bool_masked_pos``),
the encoder states of a decoder used alone (Whisper's causal LM: ``encoder_outputs``; Mllama's:
``cross_attention_states``). Each is kept only where the forward runs on it and reads a
parameter it read on none of the inputs before: ViT's classifier has no mask token, RoBERTa's
masked LM takes encoder states and ignores them, so neither gets them. Each model analysed with
no inputs reads every parameter, claims the newly read ones, certifies in float64, and the
example inputs are the same on the ``meta`` device."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.inputs import default_inputs
from symgraph.testing.models import randomized

transformers = pytest.importorskip("transformers")
T = transformers

VIT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24, image_size=16,
           patch_size=4, num_labels=3)


def _claimed(rep) -> set:
    return {p for g in rep.groups if g.kind != "identity" for p, _ in g.params}


def _keys_on_meta(build) -> set:
    with torch.device("meta"):
        m = build()
    return set(default_inputs(m)[1])


def _dinov2():
    return T.Dinov2ForImageClassification(T.Dinov2Config(**VIT))


def test_dinov2_reads_its_mask_token_on_masked_patches():
    m = randomized(_dinov2())
    _, kw = default_inputs(m)
    mask = kw["bool_masked_pos"]
    assert mask.dtype == torch.bool and mask.shape == (2, 16)  # (16 / 4)² patches per image
    assert mask[:, 1::3].all() and int(mask.sum()) == 2 * 5
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.frozen == []
    assert "dinov2.embeddings.mask_token" in _claimed(rep)
    stream = rep.group_of("dinov2.embeddings.mask_token", 1)
    assert stream and all(g.kind != "identity" for g in stream)
    assert rep.certify(m) <= 1e-6
    assert _keys_on_meta(_dinov2) == set(kw)


def test_vit_without_a_mask_token_gets_no_mask():
    m = randomized(T.ViTForImageClassification(T.ViTConfig(**VIT)))
    assert set(default_inputs(m)[1]) == {"pixel_values"}


WHISPER = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, num_mel_bins=8,
               max_source_positions=8, max_target_positions=16, pad_token_id=1, bos_token_id=2, eos_token_id=3,
               decoder_start_token_id=2)


def _whisper():
    return T.WhisperForCausalLM(T.WhisperConfig(**WHISPER))


def test_whisper_causal_lm_reads_its_cross_attention():
    m = randomized(_whisper())
    _, kw = default_inputs(m)
    assert set(kw) == {"input_ids", "encoder_outputs", "use_cache"}
    assert kw["encoder_outputs"].shape == (2, 4, 16)
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.frozen == []
    assert {"model.decoder.layers.0.encoder_attn.k_proj.weight",
            "model.decoder.layers.0.encoder_attn.v_proj.weight"} <= _claimed(rep)
    heads = [g for g in rep.group_of("model.decoder.layers.0.encoder_attn.q_proj.weight", 0) if g.kind == "perm"]
    assert [g.size for g in heads] == [4]  # the cross-attention's heads
    assert rep.certify(m) <= 1e-6
    assert _keys_on_meta(_whisper) == set(kw)


def _mllama():
    return T.MllamaForCausalLM(T.MllamaTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], max_position_embeddings=32, pad_token_id=63))


def test_mllama_causal_lm_reads_its_cross_attention_layers():
    m = randomized(_mllama())
    _, kw = default_inputs(m)
    assert kw["cross_attention_states"].shape == (2, 4, 16)
    rep = symgraph.analyze(m)
    assert rep.unread is None
    assert {"model.layers.1.cross_attn.k_proj.weight", "model.layers.1.cross_attn.o_proj.weight",
            "model.layers.1.mlp.up_proj.weight"} <= _claimed(rep)
    assert rep.certify(m) <= 1e-6
    assert _keys_on_meta(_mllama) == set(kw)


def test_a_masked_lm_that_ignores_encoder_states_gets_none():
    m = randomized(T.RobertaForMaskedLM(T.RobertaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=40)))
    assert set(default_inputs(m)[1]) == {"input_ids"}


def test_trials_leave_every_modules_mode_as_it_was():
    m = randomized(_dinov2()).train()
    m.dinov2.encoder.eval()
    before = [x.training for x in m.modules()]
    default_inputs(m)
    assert [x.training for x in m.modules()] == before


# --- main inputs of a generic name, and a vocabulary only the tokenizer states ---------------

PERCEIVER = dict(num_latents=4, d_latents=16, d_model=16, num_blocks=1, num_self_attends_per_block=1,
                 num_self_attention_heads=2, num_cross_attention_heads=1, qk_channels=8, v_channels=16,
                 vocab_size=64, max_position_embeddings=12, image_size=8, num_labels=3)


def test_perceiver_reads_token_ids_or_images_as_its_forward_takes_them():
    m = randomized(T.PerceiverForMaskedLM(T.PerceiverConfig(**PERCEIVER)))
    assert m.main_input_name == "inputs"
    _, kw = default_inputs(m)
    assert set(kw) == {"inputs"} and kw["inputs"].dtype == torch.long and kw["inputs"].shape == (2, 8)
    assert int(kw["inputs"].max()) < 64
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.groups and rep.certify(m) <= 1e-6
    assert any(g.kind != "identity" for g in rep.group_of("perceiver.embeddings.latents", 1))
    m = randomized(T.PerceiverForImageClassificationLearned(T.PerceiverConfig(**PERCEIVER)))
    _, kw = default_inputs(m)  # token ids refused (a convolution reads them): the config's images
    assert set(kw) == {"inputs"} and kw["inputs"].shape == (2, 3, 8, 8) and kw["inputs"].is_floating_point()
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.groups and rep.certify(m) <= 1e-6


def test_canine_reads_code_points_from_its_tokenizers_vocabulary():
    cfg = T.CanineConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                         num_hash_functions=2, num_hash_buckets=32, downsampling_rate=2,
                         max_position_embeddings=64, local_transformer_stride=4, num_labels=3)
    assert getattr(cfg, "vocab_size", None) is None
    m = randomized(T.CanineForSequenceClassification(cfg))
    _, kw = default_inputs(m)
    ids = kw["input_ids"]
    assert ids.shape == (2, 8) and int(ids.max()) < 0x110000 and int(ids.max()) > 255  # code points
    assert not set(ids.flatten().tolist()) & {cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id}
    rep = symgraph.analyze(m)
    assert rep.unread is None and rep.groups and rep.certify(m) <= 1e-6


def test_a_main_input_no_builder_fits_is_refused_in_one_line():
    class Tabular(T.PreTrainedModel):
        config_class = T.PretrainedConfig
        main_input_name = "state"

        def __init__(self, cfg):
            super().__init__(cfg)
            self.lin = torch.nn.Linear(5, 3)

        def forward(self, state):
            return self.lin(state)
    m = Tabular(T.PretrainedConfig())
    with pytest.raises(symgraph.errors.InputError, match="main input 'state'; pass inputs="):
        default_inputs(m)


LUKE = dict(vocab_size=64, entity_vocab_size=10, hidden_size=16, entity_emb_size=8, num_hidden_layers=1,
            num_attention_heads=4, intermediate_size=24, max_position_embeddings=32, num_labels=3)


@pytest.mark.parametrize("cls", ["LukeForMaskedLM", "LukeForSequenceClassification"])
def test_luke_reads_its_entities(cls):
    m = randomized(getattr(T, cls)(T.LukeConfig(**LUKE)))
    _, kw = default_inputs(m)
    ids, pos = kw["entity_ids"], kw["entity_position_ids"]
    assert ids.shape == (2, 2) and int(ids.min()) >= 1 and int(ids.max()) < 10
    assert pos.tolist() == [[[0, 1], [2, -1]]] * 2 and kw["entity_attention_mask"].tolist() == [[1, 1]] * 2
    rep = symgraph.analyze(m)
    assert rep.unread is None
    claimed = _claimed(rep)
    assert {"luke.entity_embeddings.entity_embeddings.weight",
            "luke.encoder.layer.0.attention.self.e2w_query.weight"} <= claimed
    # the entity embeddings' own width (8) is a class of its own, mapped up to the stream's
    assert any(g.kind != "identity" and g.size == 8
               for g in rep.group_of("luke.entity_embeddings.entity_embeddings.weight", 1))
    assert rep.certify(m) <= 1e-6


class Windowed(T.PreTrainedModel):
    """Token ids read by a compressor only over whole windows of 32 tokens (as DeepSeek V4's
    heavily compressed attention over 128); ``dead``: a layer no forward ever calls."""
    config_class = T.PretrainedConfig

    def __init__(self, cfg, dead=False):
        super().__init__(cfg)
        self.embed, self.up, self.down = nn.Embedding(64, 8), nn.Linear(8, 12), nn.Linear(12, 8)
        self.compress, self.head = nn.Linear(8, 8), nn.Linear(8, 5)
        self.dead = nn.Linear(8, 8) if dead else None

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.down(torch.relu(self.up(h)))
        usable = h.shape[1] // 32 * 32
        if usable:
            windows = h[:, :usable].reshape(h.shape[0], -1, 32, 8).mean(2)
            h = h + self.compress(windows).mean(1, keepdim=True)
        return self.head(h)


def test_token_ids_lengthened_until_a_windowed_compressor_reads_them():
    torch.manual_seed(0)
    cfg = T.PretrainedConfig(vocab_size=64, max_position_embeddings=512)
    m = Windowed(cfg).eval()
    _, kw = default_inputs(m)
    assert set(kw) == {"input_ids"} and kw["input_ids"].shape == (2, 32)  # 8, 16: no whole window
    rep = symgraph.analyze(m)
    assert rep.unread is None and "compress.weight" in _claimed(rep) and rep.certify(m) <= 1e-6
    m = Windowed(cfg, dead=True).eval()  # a layer never called: the first length that reads more
    assert default_inputs(m)[1]["input_ids"].shape == (2, 32)
    cfg = T.PretrainedConfig(vocab_size=64, max_position_embeddings=16)  # no room: eight tokens
    assert default_inputs(Windowed(cfg).eval())[1]["input_ids"].shape == (2, 8)

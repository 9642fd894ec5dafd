"""Issue 65, the new tasks' coverage: example inputs and tracing for models the table could not
trace. An encoder-decoder's encoder gets an all-ones attention mask (LongT5's local attention
and Switch Transformers' encoder build none under ``torch.export``); a speech encoder-decoder's
generic ``inputs`` are built as its encoder's main input; every config's ``use_cache`` is off
while tracing and certifying (a forward that reads its config's, and returns a cache, cannot be
exported); a forward that converts a submodule to the dtype it already has traces. Each model is
analysed with no inputs, certified in float64 and, where it has a new structure, recovered by
weights from a transformed copy."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.testing.models import randomized
from symgraph.passes.inputs import default_inputs
from symgraph.passes.trace import conversions_in_place, graph_friendly

transformers = pytest.importorskip("transformers")
T = transformers


def recovered(m, r):
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    got, want, was = symgraph.align(m, moved).apply(moved).state_dict(), m.state_dict(), moved.state_dict()
    return (max((was[k] - want[k]).abs().max().item() for k in want),
            max((got[k] - want[k]).abs().max().item() for k in want))


@pytest.mark.slow
def test_longt5_local_attention_gets_an_encoder_mask():
    cfg = T.LongT5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=1,
                         num_heads=4, local_radius=2, encoder_attention_type="local")
    m = randomized(T.LongT5ForConditionalGeneration(cfg))
    _, kw = default_inputs(m)
    assert torch.equal(kw["attention_mask"], torch.ones(2, 8, dtype=torch.long))
    assert kw["decoder_input_ids"].shape == (2, 5) and kw["use_cache"] is False
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.frozen == [] and r.certify(m) < 1e-9
    heads = [g for g in r.group_of("encoder.block.0.layer.0.LocalSelfAttention.q.weight", 0) if g.kind == "perm"]
    assert [g.size for g in heads] == [4]  # the local attention's heads, as in T5
    moved_by, left = recovered(m, r)
    assert moved_by > 0.1 and left < 1e-9


def test_decoder_only_models_get_no_mask():
    m = randomized(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                                    num_hidden_layers=1, num_attention_heads=4,
                                                    num_key_value_heads=2, max_position_embeddings=32)))
    assert set(default_inputs(m)[1]) == {"input_ids", "use_cache"}


def test_speech_encoder_decoder_reads_its_encoders_main_input():
    enc = T.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
                           conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
                           num_conv_pos_embedding_groups=2)
    dec = T.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                       intermediate_size=24, max_position_embeddings=32, is_decoder=True, add_cross_attention=True)
    m = randomized(T.SpeechEncoderDecoderModel(config=T.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)))
    assert m.main_input_name == "inputs"
    _, kw = default_inputs(m)
    assert set(kw) == {"input_values", "decoder_input_ids", "decoder_attention_mask", "use_cache",
                       "mask_time_indices"}  # handed to the encoder: its masked_spec_embed read
    assert kw["input_values"].dim() == 2 and kw["mask_time_indices"].shape == (2, 8)
    with torch.no_grad():  # raw samples the feature extractor turns into 8 frames
        assert m.encoder.feature_extractor(kw["input_values"]).shape[-1] == 8
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.certify(m) < 1e-9
    # the encoder's stream reaches the decoder only through the projection to its width and the
    # cross-attention's keys and values
    assert r.group_of("decoder.bert.encoder.layer.0.crossattention.self.key.weight", 1)


class Cached(nn.Module):
    """A forward that reads its config's ``use_cache`` (no such argument) and then returns a
    cache object, which no exported program can hold; a sub-config that holds it too."""

    def __init__(self):
        super().__init__()
        self.config, self.config.text_config = T.PretrainedConfig(), T.PretrainedConfig()
        self.config.use_cache = self.config.text_config.use_cache = True
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 3)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        if self.config.use_cache or self.config.text_config.use_cache:
            return {"logits": y, "cache": T.DynamicCache()}
        return {"logits": y}


def test_caches_are_off_while_traced_and_restored():
    torch.manual_seed(0)
    m = Cached().double().eval()
    x = torch.randn(2, 6, dtype=torch.float64)
    with graph_friendly(m):
        assert not m.config.use_cache and not m.config.text_config.use_cache
    assert m.config.use_cache and m.config.text_config.use_cache
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < 1e-12
    (hidden,) = r.group_of("up.weight", 0)
    assert hidden.kind == "scaled_perm" and set(hidden.params) == {("up.weight", 0), ("up.bias", 0), ("down.weight", 1)}
    assert m.config.use_cache  # the user's config as it was


class Router(nn.Module):
    """A router kept in float64 that converts its classifier in the forward (Switch
    Transformers: ``self.classifier = self.classifier.to(self.dtype)``)."""

    def __init__(self):
        super().__init__()
        self.up, self.classifier, self.down = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 3)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float64)
        return self.down(torch.tanh(self.classifier(torch.relu(self.up(x)))))


def test_a_conversion_that_changes_nothing_traces():
    torch.manual_seed(0)
    m = Router().double().eval()
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(Exception, match="swap"):  # torch.export alone
        torch.export.export(m, (x,), strict=False)
    r = symgraph.analyze(m, (x,))
    assert r.certify(m, (x,)) < 1e-12
    assert {g.kind for g in r.group_of("classifier.weight", 0)} == {"signed_perm"}
    with conversions_in_place():  # a conversion that changes something still converts
        assert Router().classifier.to(torch.float64).weight.dtype == torch.float64
    assert torch.nn.Module.to.__name__ == "to" and torch.nn.Module.to is nn.Module.to


@pytest.mark.slow
def test_fsmt_decoder_gets_a_mask_and_traces():
    """FSMT looks for padding in its decoder ids when given no decoder mask (``if not
    mask.any()``: a branch on the ids' values that no trace follows): all ones are given."""
    cfg = T.FSMTConfig(langs=["en", "de"], src_vocab_size=64, tgt_vocab_size=64, d_model=16, encoder_layers=1,
                       decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                       encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32)
    m = randomized(T.FSMTForConditionalGeneration(cfg))
    _, kw = default_inputs(m)
    assert torch.equal(kw["decoder_attention_mask"], torch.ones(2, 5, dtype=torch.long))
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.frozen == [] and r.certify(m) < 1e-9
    heads = [g for g in r.group_of("model.decoder.layers.0.encoder_attn.k_proj.weight", 0) if g.kind == "perm"]
    assert [g.size for g in heads] == [4]  # the cross-attention's heads
    moved_by, left = recovered(m, r)
    assert moved_by > 0.1 and left < 1e-9


def test_moonshine_raw_samples_from_its_convolutions():
    """Moonshine's convolutions over the raw samples are fixed in its code, not its config: the
    samples are sized from the Conv1d modules that read them (kernel 127 stride 64, 7/3, 3/2)."""
    cfg = T.MoonshineConfig(vocab_size=64, hidden_size=16, intermediate_size=24, encoder_num_hidden_layers=1,
                            decoder_num_hidden_layers=1, encoder_num_attention_heads=4,
                            decoder_num_attention_heads=4, max_position_embeddings=64)
    m = randomized(T.MoonshineForConditionalGeneration(cfg))
    _, kw = default_inputs(m)
    assert kw["input_values"].shape == (2, (((8 - 1) * 2 + 3 - 1) * 3 + 7 - 1) * 64 + 127)  # 3583
    with torch.no_grad():
        enc = m.get_encoder()
        x = enc.conv3(torch.tanh(enc.conv2(torch.tanh(enc.conv1(kw["input_values"][:, None])))))
    assert x.shape[-1] == 8
    r = symgraph.analyze(m)
    assert r.outputs == ("logits",) and r.certify(m) < 1e-9
    assert [g.kind for g in r.group_of("model.encoder.conv2.weight", 0)]  # the convolutions' channels

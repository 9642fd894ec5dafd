"""An example input the forward ignores is dropped (:func:`symgraph.passes.audio_inputs.drop_ignored`):
SpeechT5's top-level forward takes ``mask_time_indices`` in its ``**kwargs`` (its speech prenet takes
it by name, so the inputs offered it) but hands it to no module; a trial run with and without it
reads the same parameters and returns the same values, so the example no longer carries it. A
speech encoder that reads it (its ``masked_spec_embed``) keeps it; one told by its config not to
mask (``apply_spec_augment=False``) ignores it, and drops it."""
from __future__ import annotations

import pytest
import torch

from symgraph.passes.audio_inputs import drop_ignored
from symgraph.passes.inputs import default_inputs
from symgraph.passes.trace import flatten_outputs
from symgraph.testing.models import randomized

T = pytest.importorskip("transformers")

SPEECHT5 = dict(vocab_size=64, hidden_size=16, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=24,
                decoder_layers=1, decoder_ffn_dim=24, decoder_attention_heads=4, conv_dim=[8, 8], conv_stride=[5, 2],
                conv_kernel=[10, 3], num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=1,
                speech_decoder_prenet_layers=1, speaker_embedding_dim=8, speech_decoder_postnet_layers=1,
                max_speech_positions=64, max_text_positions=32)
WAV2VEC2 = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, conv_dim=(8, 8),
                conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
                vocab_size=12)


def _same_with_a_mask(model, kw) -> bool:
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 1::3] = True
    with torch.no_grad():
        a, b = (flatten_outputs(model(**k)) for k in (kw, {**kw, "mask_time_indices": mask}))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_speecht5_drops_the_mask_its_forward_ignores():
    m = randomized(T.SpeechT5ForSpeechToText(T.SpeechT5Config(**SPEECHT5))).eval()
    _, kw = default_inputs(m)
    assert "mask_time_indices" not in kw and {"input_values", "decoder_input_ids"} <= set(kw)
    assert _same_with_a_mask(m, kw)  # what the trial found: the forward ignores it


@pytest.mark.parametrize("augment", [True, False])
def test_a_speech_encoder_keeps_the_mask_only_where_it_reads_it(augment):
    m = randomized(T.Wav2Vec2Model(T.Wav2Vec2Config(**WAV2VEC2, apply_spec_augment=augment))).eval()
    _, kw = default_inputs(m)
    assert ("mask_time_indices" in kw) is augment
    plain = {k: v for k, v in kw.items() if k != "mask_time_indices"}
    assert _same_with_a_mask(m, plain) is not augment


class Optional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.fill = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.ones(3))

    def forward(self, x, mask: torch.Tensor | None = None, **kwargs):
        h = self.lin(x)
        return torch.where(mask.unsqueeze(-1), self.fill, h) if mask is not None else h


def test_drop_ignored_keeps_what_is_read_or_refused():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 3), torch.tensor([[True, False, False, True]] * 2)
    kw = {"x": x, "mask": mask, "unused": mask}
    drop_ignored(Optional(), kw, "unused")
    drop_ignored(Optional(), kw, "mask")
    assert set(kw) == {"x", "mask"}  # the mask reads ``fill``: kept; ``unused`` dropped
    refused = {"x": x[..., :2], "unused": mask}  # of the wrong width: both runs refuse it
    drop_ignored(Optional(), refused, "unused")
    assert set(refused) == {"x", "unused"}

"""Issue 65, an image_text_to_text row where a parameter no example input reads keeps every
parameter fixed, and the reason says only what is known: the trace took data-dependent branches
elsewhere, and no branch is claimed to read the parameter. The parameter is read by no call the
model makes, but neither static proof (``passes.deadcode``, ``passes.closed_reads``) can show it:

- UDOP: the decoder's ``embed_patches`` is read only when its stack gets ``pixel_values``, which
  ``UdopForConditionalGeneration.forward`` never hands the decoder; its ``relative_bias`` terms
  past the first (tied to the encoder's) only when the stack is no decoder. The stack's class
  reads both (the encoder is one of it), and it is a ``PreTrainedModel``, whose methods reach
  their members generically (``tie_weights``, ``to``, ``post_init``); UDOP's own file names the
  decoder in strings (its tied keys), and the stack's forward reads ``self.dtype``.

(Qwen2.5-Omni thinker's ``audio_tower.audio_bos_eos_token``, once here, is proven dead by
``passes.closed_reads``: tests/test_closed_reads.py.)
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from analyze_helpers import coverage_row
from symgraph.passes.inputs import default_inputs

pytest.importorskip("transformers")

ROWS = {
    "udop": ("UdopForConditionalGeneration",
             ["decoder.embed_patches.proj.weight", "decoder.embed_patches.proj.bias",
              "decoder.relative_bias.biases.1.relative_attention_bias.weight",
              "decoder.relative_bias.biases.2.relative_attention_bias.weight"]),
}


@pytest.mark.parametrize("model_type", sorted(ROWS))
@pytest.mark.slow
def test_an_unread_parameter_no_branch_reads_keeps_every_parameter_with_a_true_reason(model_type):
    cls, names = ROWS[model_type]
    model = coverage_row(model_type, cls).eval()
    rep = symgraph.analyze(model)
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    assert rep.unread == (f"{names[0]}{more} is not read on the example inputs, traced with "
                          "data-dependent branches: unknown")
    assert not rep.groups  # every parameter fixed: no class claimed
    assert rep.certify(model) <= 1e-6
    args, kwargs = default_inputs(model)
    with torch.no_grad():
        before = model(*args, **kwargs).logits
        params = dict(model.named_parameters())
        for n in names:  # read by no path these inputs take: NaN there changes no output
            params[n].fill_(float("nan"))
        after = model(*args, **kwargs).logits
    assert torch.equal(before, after)

"""Issue 65: a vision-language-action policy (PI0), whose example inputs failed ("cannot build
example inputs for main input 'state'"): its main input a state vector of the config's
``max_state_dim``, one camera a row counted in image tokens by its vision-language sub-model's
``get_image_features``, and the noise and time it would draw fixed, so its trace is a function.
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.passes.inputs import default_inputs
from analyze_helpers import coverage_row, unread

pytest.importorskip("transformers")


def test_a_state_vector_of_the_configs_width():
    from types import SimpleNamespace

    from symgraph.passes.policy_inputs import vector_main
    gen = torch.Generator().manual_seed(0)
    assert tuple(vector_main(SimpleNamespace(max_state_dim=7), "state", 3, gen).shape) == (3, 7)
    assert tuple(vector_main(SimpleNamespace(state_dim=5), "state", 2, gen).shape) == (2, 5)
    assert vector_main(SimpleNamespace(hidden_size=5), "state", 2, gen) is None


@pytest.mark.slow
def test_pi0_state_cameras_and_fixed_draws():
    """PI0's inputs: a state of ``max_state_dim``, one 64-pixel camera a row and as many image
    tokens as its PaliGemma's ``get_image_features`` returns (16), the noise of the shape the
    forward draws (``chunk_size × max_action_dim``) and a time a row, so two runs agree. Every
    parameter is read but the DiT's token embedding, which its forward never reads (the DiT
    takes the actions' embeddings): the analysis runs with no inputs, proves that table read
    by no method (``symgraph.passes.closed_reads``: PI0 always hands its DiT embeddings), keeps it
    fixed alone and claims the rest's classes."""
    m = coverage_row("pi0", "PI0ForConditionalGeneration")
    cfg = m.config
    _, kw = default_inputs(m)
    assert tuple(kw["state"].shape) == (2, cfg.max_state_dim)
    assert tuple(kw["noise"].shape) == (2, cfg.chunk_size, cfg.max_action_dim)
    assert tuple(kw["timestep"].shape) == (2,) and bool(((kw["timestep"] > 0) & (kw["timestep"] < 1)).all())
    assert tuple(kw["pixel_values"].shape) == (2, 1, 3, 64, 64) and kw["pixel_attention_mask"].all()
    assert ((kw["input_ids"] == cfg.vlm_config.image_token_id).sum(1) == 16).all()
    with torch.no_grad():
        a, b = m(**kw).logits, m(**kw).logits
    assert torch.equal(a, b)  # nothing drawn at random
    assert unread(m, kw) == {"model.dit.embed_tokens.weight"}
    rep = symgraph.analyze(m)
    assert rep.unread is None and "inputs_embeds is None" in rep.dead_parameters["model.dit.embed_tokens.weight"]
    assert rep.groups and not any(p == "model.dit.embed_tokens.weight" for g in rep.groups for p, _ in g.params)
    assert rep.certify(m) <= 1e-6

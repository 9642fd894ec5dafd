"""A tiny diffusers UNet2DConditionModel from its config (issue 65): GroupNorm's groups free the
ResNet channels (a permutation of the groups, one inside each group), the timestep embedding's
MLP is a class of its own, cross-attention heads are found; certified in float64, and a
transformed copy recovered by weight matching. Runs where diffusers is installed (the ``test``
extra installs it)."""
from __future__ import annotations

import pytest
import torch

import symgraph

diffusers = pytest.importorskip("diffusers")


def unet():
    m = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, attention_head_dim=4, norm_num_groups=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    m = m.eval().to(torch.float64)
    x = {"sample": torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=g), "timestep": torch.tensor([3, 7]),
         "encoder_hidden_states": torch.randn(2, 5, 8, dtype=torch.float64, generator=g)}
    return m, x


@pytest.mark.slow
def test_unet_groups_certified_and_recovered():
    m, x = unet()
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < 1e-9
    # the second down block's ResNet hidden channels: 4 groups of 4, permuted whole and inside
    hidden = r.group_of("down_blocks.1.resnets.0.conv1.weight", 0)
    assert sorted((g.kind, g.size, g.blocks) for g in hidden) == [("perm", 4, 1), ("perm", 16, 4)]
    assert all(("down_blocks.1.resnets.0.norm2.weight", 0) in g.params for g in hidden)
    # the timestep embedding's MLP hidden units
    (temb,) = r.group_of("time_embedding.linear_1.weight", 0)
    assert temb.kind == "perm" and ("time_embedding.linear_2.weight", 1) in temb.params
    # cross-attention: queries from the image, keys from the text; per-head classes
    attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn2"
    assert r.group_of(f"{attn}.to_q.weight", 0) == r.group_of(f"{attn}.to_k.weight", 0) != []
    moved = symgraph.transform(m, r.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved, x)
    got, want, was = al.apply(moved).state_dict(), m.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6

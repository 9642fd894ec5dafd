"""Tiny diffusers models built from their configs, in float64 with seeded weights, and example
inputs for each: the UNet (``UNet2DConditionModel``), the DiT, SD3's MMDiT, Flux and the VAE
(``AutoencoderKL``). Read by tests/test_diffusers_transformers.py and the diffusers coverage
benchmark (``python -m benchmarks coverage_diffusers``). Needs diffusers (the ``diffusers``
extra); nothing is downloaded."""
from __future__ import annotations

import torch

__all__ = ["BUILDERS", "build", "fixed_params"]


def _init(model, gen):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval().to(torch.float64)


def _randn(gen, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=gen)


def unet(d, g):
    m = _init(d.UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, attention_head_dim=4, norm_num_groups=4), g)
    return m, {"sample": _randn(g, 2, 3, 8, 8), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": _randn(g, 2, 5, 8)}


def dit(d, g):
    m = _init(d.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1,
        sample_size=4, patch_size=2, num_embeds_ada_norm=10), g)
    return m, {"hidden_states": _randn(g, 2, 4, 4, 4), "timestep": torch.tensor([3, 7]),
               "class_labels": torch.tensor([1, 2])}


def sd3(d, g):
    m = _init(d.SD3Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=6, out_channels=4,
        pos_embed_max_size=8), g)
    return m, {"hidden_states": _randn(g, 2, 4, 4, 4), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": _randn(g, 2, 5, 12), "pooled_projections": _randn(g, 2, 6)}


def flux(d, g):
    m = _init(d.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=6, guidance_embeds=False,
        axes_dims_rope=(2, 2, 4)), g)
    return m, {"hidden_states": _randn(g, 2, 6, 8), "timestep": torch.tensor([0.3, 0.7], dtype=torch.float64),
               "encoder_hidden_states": _randn(g, 2, 5, 12), "pooled_projections": _randn(g, 2, 6),
               "img_ids": _randn(g, 6, 3), "txt_ids": torch.zeros(5, 3, dtype=torch.float64)}


def vae(d, g):
    m = _init(d.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=8), g)
    return m, {"sample": _randn(g, 2, 3, 8, 8)}


#: name -> builder ``(diffusers module, generator) -> (model, example inputs)``.
BUILDERS = {"unet": unet, "dit": dit, "sd3": sd3, "flux": flux, "vae": vae}


def build(name: str, seed: int = 0):
    """``(model, inputs)``: the tiny float64 diffusers model ``name`` (one of :data:`BUILDERS`)
    with weights drawn from ``seed`` (N(0, 0.3²)), and its example inputs (a dict of keywords)."""
    import diffusers
    return BUILDERS[name](diffusers, torch.Generator().manual_seed(seed))


def fixed_params(model, report) -> list:
    """The names of ``model``'s parameters that no group of ``report`` acts on along any
    dimension, the gains and shifts of folded norms aside (they fold into their readers)."""
    folded = {n for f in report.folds for n in (f.gain, f.shift) if n}
    return [n for n, p in model.named_parameters()
            if n not in folded and not any(report.group_of(n, d) for d in range(p.ndim))]

"""Tiny diffusers models from their configs (issue 65): the DiT, SD3's MMDiT, Flux and the VAE
(AutoencoderKL). Each is analysed with no op left without a rule, certified in float64, and a
randomly transformed copy recovered by weight matching. What each test pins down:

- DiT: adaLN-Zero's modulation (``x * (1 + scale) + shift``, scale and shift from a linear of
  the timestep and class embedding) moves with the residual stream, and so does the fixed
  position table it adds;
- SD3: the position table is viewed as a grid, cropped and flattened before it is added (the
  chain of views in ``symgraph.passes.bufferviews``): the image stream stays free (it was fixed
  before); joint attention shares its heads between the image and the text projections, while
  the two streams stay classes of their own;
- Flux: the single blocks concatenate text and image tokens along the sequence, so both streams
  are one class; query/key RMSNorm gains before the rotary embedding leave no per-head query-key
  class (only the heads' permutation), and the gains stay fixed;
- VAE: GroupNorm frees encoder and decoder channels, the latent between ``quant_conv`` and
  ``post_quant_conv`` is a class of its own.
Runs where diffusers is installed (the ``test`` extra installs it)."""
from __future__ import annotations

import pytest
import torch

import symgraph

diffusers = pytest.importorskip("diffusers")


def _init(model, gen):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval().to(torch.float64)


def _randn(gen, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=gen)


def dit():
    g = torch.Generator().manual_seed(0)
    m = _init(diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1,
        sample_size=4, patch_size=2, num_embeds_ada_norm=10), g)
    return m, {"hidden_states": _randn(g, 2, 4, 4, 4), "timestep": torch.tensor([3, 7]),
               "class_labels": torch.tensor([1, 2])}


def sd3():
    g = torch.Generator().manual_seed(0)
    m = _init(diffusers.SD3Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=6, out_channels=4,
        pos_embed_max_size=8), g)
    return m, {"hidden_states": _randn(g, 2, 4, 4, 4), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": _randn(g, 2, 5, 12), "pooled_projections": _randn(g, 2, 6)}


def flux():
    g = torch.Generator().manual_seed(0)
    m = _init(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=6, guidance_embeds=False,
        axes_dims_rope=(2, 2, 4)), g)
    return m, {"hidden_states": _randn(g, 2, 6, 8), "timestep": torch.tensor([0.3, 0.7], dtype=torch.float64),
               "encoder_hidden_states": _randn(g, 2, 5, 12), "pooled_projections": _randn(g, 2, 6),
               "img_ids": _randn(g, 6, 3), "txt_ids": torch.zeros(5, 3, dtype=torch.float64)}


def vae():
    g = torch.Generator().manual_seed(0)
    m = _init(diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=8), g)
    return m, {"sample": _randn(g, 2, 3, 8, 8)}


MODELS = {"dit": dit, "sd3": sd3, "flux": flux, "vae": vae}


def fixed_params(model, report) -> list:
    """Parameters no group acts on, folded norm gains and shifts aside."""
    folded = {n for f in report.folds for n in (f.gain, f.shift) if n}
    return [n for n, p in model.named_parameters()
            if n not in folded and not any(report.group_of(n, d) for d in range(p.ndim))]


def recovered(model, report, x) -> tuple[float, float]:
    """(how far a random transform moved the weights, how far the alignment left them)."""
    moved = symgraph.transform(model, report.random_transform(seed=3, orthogonal=True))
    got = symgraph.align(model, moved, x).apply(moved).state_dict()
    want, was = model.state_dict(), moved.state_dict()
    return (max((was[k] - want[k]).abs().max().item() for k in want),
            max((got[k] - want[k]).abs().max().item() for k in want))


@pytest.mark.parametrize("name,only_fixed", [
    ("dit", ["proj_out_2.bias"]), ("sd3", ["proj_out.bias"]), ("vae", ["decoder.conv_out.bias"]),
    ("flux", ["transformer_blocks.0.attn.norm_q.weight", "transformer_blocks.0.attn.norm_k.weight",
              "transformer_blocks.0.attn.norm_added_q.weight", "transformer_blocks.0.attn.norm_added_k.weight",
              "single_transformer_blocks.0.attn.norm_q.weight", "single_transformer_blocks.0.attn.norm_k.weight",
              "proj_out.bias"])])
def test_certified_recovered_and_only_outputs_fixed(name, only_fixed):
    m, x = MODELS[name]()
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.fixed_buffers == {}
    assert r.certify(m, x) < 1e-9
    # the output layer's bias (the output's channels) and, in Flux, the query/key norm gains
    assert fixed_params(m, r) == only_fixed
    moved, left = recovered(m, r, x)
    assert moved > 0.1 and left < 1e-6


def test_dit_adaln_modulation_and_position_table_move_with_the_stream():
    m, x = dit()
    r = symgraph.analyze(m, x)
    (stream,) = r.group_of("pos_embed.proj.weight", 0)
    assert stream.kind == "perm" and stream.size == 16
    # shift, scale and gate of adaLN-Zero: six chunks of the stream
    assert r.group_of("transformer_blocks.0.norm1.linear.weight", 0) == [stream]
    assert ("pos_embed.pos_embed", 2) in stream.buffers
    # the conditioning embedding (timestep MLP's output and class table) is a class of its own
    (cond,) = r.group_of("transformer_blocks.0.norm1.linear.weight", 1)
    assert cond != stream and r.group_of("transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight", 1) == [cond]


def test_sd3_cropped_position_table_and_joint_attention():
    m, x = sd3()
    r = symgraph.analyze(m, x)
    (image,) = r.group_of("pos_embed.proj.weight", 0)
    (text,) = r.group_of("context_embedder.weight", 0)
    assert image != text and image.kind == text.kind == "perm"
    assert ("pos_embed.pos_embed", 2) in image.buffers  # viewed 8 x 8, cropped, flattened, added
    assert r.group_of("transformer_blocks.0.norm1.linear.weight", 0) == [image]
    assert r.group_of("transformer_blocks.0.norm1_context.linear.weight", 0) == [text]
    attn = "transformer_blocks.0.attn"
    heads = r.group_of(f"{attn}.to_q.weight", 0)
    assert sorted((g.kind, g.size, g.blocks) for g in heads) == [("gl", 16, 2), ("perm", 2, 1)]
    assert r.group_of(f"{attn}.add_q_proj.weight", 0) == heads == r.group_of(f"{attn}.add_k_proj.weight", 0)


def test_flux_one_stream_and_rotary_heads():
    m, x = flux()
    r = symgraph.analyze(m, x)
    (stream,) = r.group_of("x_embedder.weight", 0)
    assert r.group_of("context_embedder.weight", 0) == [stream]  # tokens concatenated
    attn = "transformer_blocks.0.attn"
    (heads,) = r.group_of(f"{attn}.to_q.weight", 0)
    assert (heads.kind, heads.size) == ("perm", 2) and r.group_of(f"{attn}.add_k_proj.weight", 0) == [heads]
    assert sorted((g.kind, g.size, g.blocks) for g in r.group_of(f"{attn}.to_v.weight", 0)) == [
        ("gl", 16, 2), ("perm", 2, 1)]


def test_vae_latent_and_group_norm_channels():
    m, x = vae()
    r = symgraph.analyze(m, x)
    (latent,) = r.group_of("post_quant_conv.weight", 1)
    assert latent.kind == "gl" and latent.size == 4 and ("quant_conv.weight", 0) in latent.params
    hidden = r.group_of("encoder.down_blocks.1.resnets.0.conv1.weight", 0)
    assert sorted((g.kind, g.size, g.blocks) for g in hidden) == [("perm", 4, 1), ("perm", 16, 4)]

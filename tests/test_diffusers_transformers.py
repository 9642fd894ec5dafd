"""Tiny diffusers models from their configs (issue 65): the DiT, SD3's MMDiT, Flux and the VAE
(AutoencoderKL). Each is analysed with no op left without a rule, certified in float64, and a
randomly transformed copy recovered by weight matching. What each test pins down:

- DiT: its sine-cosine position table is a non-persistent buffer (no checkpoint holds it;
  loading computes it again), added to the residual stream, so the stream stays as it is; the
  timestep and class embedding that adaLN-Zero's modulation (``x * (1 + scale) + shift``)
  reads is a class of its own;
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

import symgraph

diffusers = pytest.importorskip("diffusers")
from symgraph.testing.diffusion import build, fixed_params  # noqa: E402


def recovered(model, report, x) -> tuple[float, float]:
    """(how far a random transform moved the weights, how far the alignment left them)."""
    moved = symgraph.transform(model, report.random_transform(seed=3, orthogonal=True))
    got = symgraph.align(model, moved, x).apply(moved).state_dict()
    want, was = model.state_dict(), moved.state_dict()
    return (max((was[k] - want[k]).abs().max().item() for k in want),
            max((got[k] - want[k]).abs().max().item() for k in want))


DIT_STREAM = ["pos_embed.proj.weight", "pos_embed.proj.bias", "transformer_blocks.0.norm1.linear.bias",
              "transformer_blocks.0.attn1.to_out.0.bias", "transformer_blocks.0.ff.net.2.bias", "proj_out_1.bias",
              "proj_out_2.weight", "proj_out_2.bias"]


@pytest.mark.parametrize("name,only_fixed", [
    ("dit", DIT_STREAM), ("sd3", ["proj_out.bias"]), ("vae", ["decoder.conv_out.bias"]),
    ("flux", ["transformer_blocks.0.attn.norm_q.weight", "transformer_blocks.0.attn.norm_k.weight",
              "transformer_blocks.0.attn.norm_added_q.weight", "transformer_blocks.0.attn.norm_added_k.weight",
              "single_transformer_blocks.0.attn.norm_q.weight", "single_transformer_blocks.0.attn.norm_k.weight",
              "proj_out.bias"])])
@pytest.mark.slow
def test_certified_recovered_and_only_outputs_fixed(name, only_fixed):
    m, x = build(name)
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and list(r.fixed_buffers) == (["pos_embed.pos_embed"] if name == "dit" else [])
    assert r.certify(m, x) < 1e-9
    # the output layer's bias (the output's channels) and, in Flux, the query/key norm gains
    assert fixed_params(m, r) == only_fixed
    moved, left = recovered(m, r, x)
    assert moved > 0.1 and left < 1e-6


def test_dit_stream_stays_as_its_unsaved_position_table_is():
    m, x = build("dit")
    r = symgraph.analyze(m, x)
    assert r.group_of("pos_embed.proj.weight", 0) == [] == r.group_of("transformer_blocks.0.norm1.linear.weight", 0)
    assert "non-persistent" in r.fixed_buffers["pos_embed.pos_embed"]
    # the conditioning embedding (timestep MLP's output and class table) is a class of its own
    (cond,) = r.group_of("transformer_blocks.0.norm1.linear.weight", 1)
    assert cond.kind == "perm" and cond.size == 16
    assert r.group_of("transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight", 1) == [cond]


def test_sd3_cropped_position_table_and_joint_attention():
    m, x = build("sd3")
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
    m, x = build("flux")
    r = symgraph.analyze(m, x)
    (stream,) = r.group_of("x_embedder.weight", 0)
    assert r.group_of("context_embedder.weight", 0) == [stream]  # tokens concatenated
    attn = "transformer_blocks.0.attn"
    (heads,) = r.group_of(f"{attn}.to_q.weight", 0)
    assert (heads.kind, heads.size) == ("perm", 2) and r.group_of(f"{attn}.add_k_proj.weight", 0) == [heads]
    assert sorted((g.kind, g.size, g.blocks) for g in r.group_of(f"{attn}.to_v.weight", 0)) == [
        ("gl", 16, 2), ("perm", 2, 1)]


def test_vae_latent_and_group_norm_channels():
    m, x = build("vae")
    r = symgraph.analyze(m, x)
    (latent,) = r.group_of("post_quant_conv.weight", 1)
    assert latent.kind == "gl" and latent.size == 4 and ("quant_conv.weight", 0) in latent.params
    hidden = r.group_of("encoder.down_blocks.1.resnets.0.conv1.weight", 0)
    assert sorted((g.kind, g.size, g.blocks) for g in hidden) == [("perm", 4, 1), ("perm", 16, 4)]


@pytest.mark.slow
def test_unet_group_norm_straddling_the_skip_join():
    # the up path concatenates 16 channels and an 8-channel skip, normalised in 4 groups of 6:
    # the third group holds 4 of the one and 2 of the other. Its channels were all fixed (with
    # conv_in and the first down block, which feed the skip); now only groups stay in place
    m, x = build("unet")
    r = symgraph.analyze(m, x)
    assert r.frozen == [] and r.certify(m, x) < 1e-9
    assert fixed_params(m, r) == ["conv_out.bias"]
    norm = "up_blocks.0.resnets.1.norm1.weight"
    assert r.group_of(norm, 0) != [] and all(g.kind == "perm" and g.size < 6 for g in r.group_of(norm, 0))
    assert r.group_of("conv_in.weight", 0) != []
    moved, left = recovered(m, r, x)
    assert moved > 0.1 and left < 1e-6

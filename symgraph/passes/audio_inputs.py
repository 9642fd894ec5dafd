"""Audio for example inputs (see :mod:`.inputs`): raw samples, log-mel features, a speech
language model's audio and its audio tokens, masked time steps."""
from __future__ import annotations

import inspect

import torch

from ..errors import InputError
from .input_values import config_value, ints

__all__ = ["audio_tokens", "features", "samples", "time_mask"]


def _raw_convolutions(model) -> list:
    """``(kernel, stride)`` of the 1-d convolutions that read raw samples, for a config that
    does not state them (Moonshine's are fixed in its code): the first ``Conv1d`` with one
    input channel and each next one (in module order) whose input is the last one's output."""
    chain: list[tuple[int, int, int]] = []
    for m in model.modules() if model is not None else ():
        if isinstance(m, torch.nn.Conv1d) and (m.in_channels == 1 if not chain else m.in_channels == chain[-1][2]):
            chain.append((m.kernel_size[0], m.stride[0], m.out_channels))
        elif isinstance(m, torch.nn.Conv1d) and chain:
            break
    return [(k, s) for k, s, _ in chain]


def samples(cfg, frames: int = 8, model=None) -> int:
    """Raw audio samples that leave ``frames`` frames after the feature extractor's convolutions."""
    kernels, strides = ints(config_value(cfg, "conv_kernel") or []), ints(config_value(cfg, "conv_stride") or [])
    n, convs = frames, list(zip(kernels, strides)) or _raw_convolutions(model)
    for k, s in reversed(convs):
        n = (n - 1) * s + k
    return n


def features(model, cfg, batch, gen):
    mel, src = config_value(cfg, "num_mel_bins"), config_value(cfg, "max_source_positions")
    if mel and src:  # Whisper: channels first, twice the encoder's positions
        return torch.randn(batch, mel, 2 * src, generator=gen)
    feat = config_value(cfg, "input_feat_per_channel")
    if feat:  # Speech2Text: frames first
        return torch.randn(batch, 16, feat * (config_value(cfg, "input_channels") or 1), generator=gen)
    width = config_value(cfg, "feature_projection_input_dim") or mel
    if width:  # frames first (SeamlessM4T, Wav2Vec2-BERT; conformers: Parakeet, Canary), enough
        return torch.randn(batch, 8 * (config_value(cfg, "subsampling_factor") or 8), width, generator=gen)
    raise InputError(f"cannot tell the shape of {type(model).__name__}'s input_features from its config; pass inputs=")


def _feature_mask(fn, feats, mel) -> dict:
    """An all-ones mask of the feature frames (the axis that is not ``mel`` channels wide),
    under the name ``fn`` takes it by, if any (``input_features_mask``, ``feature_attention_mask``)."""
    names = [n for n in inspect.signature(fn).parameters if "feature" in n and n.endswith("mask")]
    frames = feats.shape[2] if feats.shape[1] == mel else feats.shape[1]
    return {names[0]: torch.ones(feats.shape[0], frames, dtype=torch.long)} if names else {}


def audio_tokens(model, kwargs, params, batch, gen) -> None:
    """A speech language model (Audio Flamingo 3, GLM-ASR) reads audio where its token ids
    hold its audio token: log-mel features of its audio config's shape (frames first, else
    channels first: the layout its own ``get_audio_features`` takes), and in each row as many
    audio tokens as that gives embeddings; text only where it takes neither (the report then
    names a parameter the inputs never read)."""
    cfg = model.config
    token, audio = ints(config_value(cfg, "audio_token_id", "audio_token_index")), getattr(cfg, "audio_config", None)
    fn = getattr(model, "get_audio_features", None)
    if not token or audio is None or fn is None or "input_features" not in params:
        return
    try:
        feats = features(model, audio, batch, gen).to(next(model.parameters()).dtype)
    except InputError:  # an audio config that does not tell its features' shape: text only
        return
    out, mel = None, config_value(audio, "num_mel_bins", "feature_size")
    for f in (feats, feats.transpose(1, 2)):  # frames first, or channels first (GLM-ASR)
        try:
            with torch.no_grad():
                out = fn(f, **_feature_mask(fn, f, mel))
        except Exception:  # noqa: BLE001 - the other layout, or no audio tokens at all
            continue
        feats = f
        break
    masks = _feature_mask(model.forward, feats, mel)
    emb = getattr(out, "pooler_output", out)
    width = config_value(cfg, "hidden_size")
    if not isinstance(emb, torch.Tensor) or not width or emb.numel() % (batch * width):
        return
    n, ids = emb.numel() // (batch * width), kwargs["input_ids"]
    kwargs["input_ids"] = torch.cat([ids[:, :1], torch.full((batch, n), token[0], dtype=ids.dtype), ids[:, 1:]], 1)
    kwargs["input_features"] = feats
    kwargs.update(masks)


def time_mask(model, kwargs, name, batch) -> None:
    """Time steps to mask (``mask_time_indices``, where the forward takes it: Wav2Vec2, HuBERT,
    SEW): every third frame after the feature extractor, so the program reads the masked
    frames' learned embedding (``masked_spec_embed``) as any input that masks would."""
    x = kwargs[name]
    lengths = next((m._get_feat_extract_output_lengths for m in model.modules()
                    if hasattr(m, "_get_feat_extract_output_lengths")), None)  # the encoder's
    if name == "input_values" and lengths is not None:
        frames = int(lengths(torch.tensor(x.shape[-1])))
    elif name == "input_features" and x.dim() == 3:
        frames = x.shape[1]
    else:
        return
    mask = torch.zeros(batch, frames, dtype=torch.bool)
    mask[:, 1::3] = True
    kwargs["mask_time_indices"] = mask

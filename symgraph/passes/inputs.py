"""Example inputs for a Hugging Face model, built from its config and its forward's signature
(no data): ``symgraph.analyze(model)`` needs no ``inputs=`` for any task transformers ships
that this module knows the main input of.

- token ids (``input_ids``) in range of the vocabulary, the config's own or its text
  config's (Gemma 3, Fuyu), else its input embeddings' rows, else its tokenizer's where that
  is built with no files (CANINE: Unicode code points), avoiding every special token the
  config names (padding, end-of-sequence, image tokens); a sequence
  classification head of an encoder-decoder (BART, T5) reads the end-of-sequence token, so each
  row ends with exactly one;
- images (``pixel_values``) at the config's image size and channels, the vision config's in a
  model of two towers (CLIP: token ids and images) and in a vision-language model whose config
  states its tokens per image (Gemma 3: that many image tokens in each row); other
  vision-language models get text only;
- audio: raw samples (``input_values``, Wav2Vec2, HuBERT) long enough for the feature
  extractor's convolutions to leave several frames, or a spectrogram of the configured length
  (AST); log-mel features (``input_features``) of the shape the encoder expects (Whisper:
  ``2 × max_source_positions`` frames, channels first; frames first elsewhere, eight per step
  of the encoder's subsampling);
- a speech language model's audio (``input_features``) and as many audio tokens as its
  ``get_audio_features`` returns; masked frames (``mask_time_indices``) wherever the forward
  or, through its ``**kwargs``, its encoder takes them (Wav2Vec2, HuBERT): every tower the
  signature can reach is read, since one the trace never reads leaves nothing claimed;
- a main input of a generic name (Perceiver's ``inputs``): token ids or images, the first
  the forward runs on; a policy's state vector, its cameras and the noise and time it would
  draw (PI0: :mod:`.policy_inputs`);
- a draft model's target states (Gemma 4's assistant: ``shared_kv_states`` and the target's
  hidden states as ``inputs_embeds``, :mod:`.shared_inputs`), where its forward takes both;
- decoder inputs of an encoder-decoder (``decoder_input_ids``: its start token, then token
  ids; for a sequence classification head the ids shifted right, as its model would build);
- ``use_cache=False`` wherever the forward takes it by name, and through its ``**kwargs`` where
  it refuses the inputs without (a hybrid cache of linear-attention layers only); floating
  inputs in the model's dtype;
- optional inputs that read parameters the main input leaves unread (masked patches,
  entities, a decoder's encoder states, a document's boxes and page; token ids alone
  lengthened), each kept where the
  forward reads more parameters on it.

Values read from the config are in :mod:`.input_values`, images in :mod:`.image_inputs`, audio
in :mod:`.audio_inputs`, optional inputs in :mod:`.optional_inputs`; a diffusers model's example
inputs come from :mod:`.diffusion_inputs`.
"""
from __future__ import annotations

import inspect

import torch

from ..errors import InputError
from .audio_inputs import audio_tokens, drop_ignored, features, refused_audio, samples, time_mask
from .diffusion_inputs import diffusers_inputs, is_diffusers
from .experts import batched_experts
from .image_inputs import image_tokens
from .input_values import config_value, device_of, ints, pixels, token_ids
from .optional_inputs import (Trials, caches_off, encoder_states, entities, long_enough, masked_patches,
                              passes_on, text_extras)
from .paired_inputs import decoder_channels, global_tokens, paired_inputs
from .patch_inputs import flattened_patches, patches_beside_text
from .policy_inputs import vector_main
from .shared_inputs import shared_states

__all__ = ["default_inputs", "is_hf"]


def is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _main(model, cfg, name, batch, seq, gen):
    if name == "input_ids":
        return token_ids(model, cfg, batch, seq, gen)
    if name == "pixel_values":
        return pixels(model, cfg, batch, gen)
    if name == "input_values":
        mel, frames = config_value(cfg, "num_mel_bins"), config_value(cfg, "max_length")
        if mel and isinstance(frames, int):  # a spectrogram (Audio Spectrogram Transformer)
            return torch.randn(batch, frames, mel, generator=gen)
        return torch.randn(batch, samples(cfg, model=model), generator=gen)
    if name == "input_features":
        return features(model, cfg, batch, gen)
    if name == "flattened_patches":  # Pix2Struct's patches with their rows and columns
        x = flattened_patches(model, config_value(cfg, "vision_config") or cfg, batch, gen)
        if x is not None:
            return x
    return _generic_main(model, cfg, name, batch, seq, gen)


def _generic_main(model, cfg, name, batch, seq, gen):
    """A main input of a generic name (Perceiver's ``inputs``): token ids, else images, the
    first the forward runs on; a vector of the width the config states for it (PI0's ``state``)."""
    vector = vector_main(cfg, name, batch, gen)
    if vector is not None:
        return vector
    for build in (lambda: token_ids(model, cfg, batch, seq, gen), lambda: pixels(model, cfg, batch, gen)):
        try:
            x = build()
        except InputError:
            continue
        if Trials(model, {}).reads({name: x}) is not None:
            return x
    raise InputError(f"cannot build example inputs for main input {name!r}; pass inputs=")


_MAIN = ("input_ids", "pixel_values", "input_values", "input_features")


def _main_input(model, params):
    """The main input's name and the config it is built from: the model's own, or, where the
    model names a generic one (a speech encoder-decoder's ``inputs``), its encoder's when the
    forward takes that by name too (``input_values``, ``input_features``)."""
    name = getattr(model, "main_input_name", "input_ids")
    enc = model.get_encoder() if name not in _MAIN and hasattr(model, "get_encoder") else None
    sub = getattr(enc, "main_input_name", None)
    if sub in _MAIN and sub in params and getattr(enc, "config", None) is not None:
        return sub, enc.config
    return name, model.config


def default_inputs(model, batch: int = 2, seq: int = 8):
    """Example inputs for a Hugging Face model, built from its config (no data needed); see the
    module's docstring; a diffusers model's: :mod:`.diffusion_inputs`. Returns ``(args, kwargs)``.
    Every trial run of the forward and its feature functions runs under the experts
    implementation the trace runs under (:mod:`.experts`), so the inputs do not depend on the
    model's dtype (``grouped_mm`` has no float64 kernel: every trial would fail)."""
    if is_diffusers(model):
        return diffusers_inputs(model)
    if not is_hf(model):
        raise InputError(
            f"{type(model).__name__} is not a Hugging Face model, so symgraph cannot build "
            "example inputs for it; pass inputs=(tensor, ...) positional inputs or a dict of "
            "keyword inputs.")
    with batched_experts(model):
        return _hf_inputs(model, batch, seq)


def _hf_inputs(model, batch: int, seq: int):
    """:func:`default_inputs` of a Hugging Face model."""
    cfg, dev = model.config, device_of(model)
    params = inspect.signature(model.forward).parameters
    name, main_cfg = _main_input(model, params)
    gen = torch.Generator().manual_seed(0)
    kwargs = {name: _main(model, main_cfg, name, batch, seq, gen)}
    if name in ("input_values", "input_features"):  # the extractor's where the config's is refused
        refused_audio(model, kwargs, name, params, batch, gen)
    two_towers = getattr(cfg, "vision_config", None) is not None and config_value(
        cfg, "image_token_id", "image_token_index") is None
    if name == "input_ids" and "pixel_values" in params and two_towers:  # CLIP-like
        kwargs["pixel_values"] = pixels(model, cfg.vision_config, batch, gen)
    elif name == "input_ids" and "pixel_values" in params:
        image_tokens(model, kwargs, cfg, batch, gen)
    patches_beside_text(model, kwargs, cfg, batch, gen)  # beside token ids (Kosmos-2.5)
    if name == "input_ids" and ({"input_features", "input_values", "audio_input_ids"} & set(params)):
        audio_tokens(model, kwargs, params, batch, gen)
    paired_inputs(model, kwargs, params, name, batch, seq, gen)  # text beside images, languages
    shared_states(model, kwargs, params, cfg, batch, gen)  # a draft model's target states (Gemma 4's)
    if passes_on(model, params, "mask_time_indices"):
        time_mask(model, kwargs, name, batch)
    trials = Trials(model, kwargs)
    caches_off(model, trials, params)
    if name == "pixel_values":
        masked_patches(model, trials, params, batch)
    if name == "input_ids":
        entities(trials, params, cfg, batch, gen)
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        start = ints(config_value(cfg, "decoder_start_token_id", "pad_token_id"))
        ids = kwargs[name]
        if type(model).__name__.endswith("ForSequenceClassification") and name == "input_ids":
            dec = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)  # the ids shifted right
        else:
            # an odd length (5 of 8): no head, batch or stream axis has its size, so a view that
            # reorders axes of one size (ProphetNet's relative-position bias rows) cannot make
            # the decoder's positions one class with its heads (at 4 = its heads it did)
            dec = token_ids(model, cfg, batch, seq // 2 + 1 if seq > 3 else 2, gen)
        dec[:, 0] = start[0] if start else 0
        kwargs["decoder_input_ids"] = dec
        if name == "input_ids" and "attention_mask" in params:  # the encoder's: all ones (a
            # traced encoder stack makes none: LongT5's, Switch Transformers')
            kwargs["attention_mask"] = torch.ones_like(ids)
        if "decoder_attention_mask" in params:  # all ones: a decoder that would look for padding
            # in its ids otherwise branches on their values (FSMT), which no trace can follow
            kwargs["decoder_attention_mask"] = torch.ones_like(dec)
        decoder_channels(model, kwargs, cfg, batch, gen)  # a column per channel (Dia)
    elif name == "input_ids":
        encoder_states(trials, params, cfg, batch, gen)
        long_enough(model, trials, cfg, batch, gen)
    if name == "input_ids":  # boxes (and a page) once the decoder's inputs are there (UDOP)
        text_extras(trials, params, cfg, batch, gen)  # boxes; segments, a query stream (XLNet)
        global_tokens(trials, params, batch)  # the first token attends globally (LED)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kwargs = {k: v if not isinstance(v, torch.Tensor) else v.to(dev, dtype) if v.is_floating_point() else v.to(dev)
              for k, v in kwargs.items()}  # a flag (``sample=False``) as it is
    if "use_cache" in params:
        kwargs["use_cache"] = False
    drop_ignored(model, kwargs, "mask_time_indices")  # a forward may take it in **kwargs, unread
    return (), kwargs

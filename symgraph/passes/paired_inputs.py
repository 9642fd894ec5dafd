"""Inputs a forward needs beside its main one (see :mod:`.inputs`), built from its signature and
its config, never from the model's name:

- text for a model whose main input is images and whose forward also takes token ids (BLIP's
  captioner, BLIP-2, InstructBLIP, Kosmos-2): token ids of the text config's vocabulary, with
  as many image tokens (the config's ``image_token_id``) as its query tokens
  (``num_query_tokens``, ``latent_query_num``) where the config names one; the positions the
  image's embeddings take where the forward takes their mask (``image_embeds_position_mask``);
- an image as rows of patches with their grid (``spatial_shapes``, NaFlex: SigLIP 2) where
  the forward takes that grid;
- a video's frames where the main images are one (the config names a video token and the
  forward takes no separate videos: InstructBLIP-Video), each frame its own query tokens;
- a second tokenizer's ids (``qformer_input_ids``: the instruction a Q-Former reads) in range of
  the vocabulary of the sub-config of that name (``qformer_config``), or of its encoder's
  (``protein_encoder_config``: the protein sequence Evolla's encoder reads);
- one image a row (``pixel_values`` of ``batch × 1 × C × H × W``) that every token attends to
  where the forward takes which images each token sees (``image_attention_mask``: Idefics);
- one row of token ids per codebook (``num_codebooks``) where the forward refuses one per
  example (MusicGen's decoder), else a column per codebook (and one of text: Kyutai);
- each row's language (``lang_ids``: X-MOD's adapters), one of the config's ``languages``;
- decoder ids with one column per channel of the decoder config (``num_channels``,
  ``num_codebooks``) where the forward refuses one a position (Dia's audio codes);
- the first token of each row attending globally (``global_attention_mask``: Longformer, LED);
- a policy's cameras and the noise and time it would draw (PI0: :mod:`.policy_inputs`).
"""
from __future__ import annotations

import torch

from .image_processing import patch_rows
from .input_values import config_value, ints, token_ids
from .optional_inputs import Trials
from .policy_inputs import camera_images, drawn_inputs

__all__ = ["decoder_channels", "global_tokens", "paired_inputs"]

FRAMES = 2  # the frames of an example video


def paired_inputs(model, kwargs: dict, params, name: str, batch: int, seq: int, gen) -> None:
    """Add to ``kwargs`` (the main input's) what the forward (``params``) needs beside it: see the
    module's docstring."""
    cfg = model.config
    if name == "pixel_values" and "spatial_shapes" in params and kwargs[name].dim() == 4:
        # NaFlex: the image as rows of patches, with their grid and mask (SigLIP 2's classifier)
        rows = patch_rows(getattr(cfg, "vision_config", None) or cfg, params, batch, gen)
        kwargs.update(rows[0] if rows else {})
    frames = 1
    if name == "pixel_values" and kwargs[name].dim() == 4 and "pixel_values_videos" not in params \
            and config_value(cfg, "video_token_id", "video_token_index") is not None:
        frames = FRAMES  # its images are a video's frames (InstructBLIP-Video)
        kwargs[name] = torch.stack([kwargs[name]] * frames, dim=1)
    text = name != "input_ids" and "input_ids" in params and "input_ids" not in kwargs
    if text:
        _text_for_images(model, kwargs, params, cfg, batch, seq, gen, frames)
    for key in [p for p in params if p.endswith("_input_ids") and p != "decoder_input_ids"]:
        pre = key[:-len("input_ids")]  # qformer_ -> qformer_config; protein_ -> its encoder's
        sub = getattr(cfg, pre + "config", None) or getattr(cfg, pre + "encoder_config", None)  # (Evolla)
        vocab = getattr(sub, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0 and key not in kwargs:
            kwargs[key] = token_ids(model, sub, batch, seq, gen)
            mask = key[:-len("input_ids")] + "attention_mask"
            if mask in params:
                kwargs[mask] = torch.ones_like(kwargs[key])
    px, ids = kwargs.get("pixel_values"), kwargs.get("input_ids")
    if "image_attention_mask" in params and px is not None and px.dim() == 4 and ids is not None:
        # one image a row, every token attending to it (Idefics' gated cross-attention)
        kwargs["pixel_values"] = px.unsqueeze(1)
        kwargs["image_attention_mask"] = torch.ones(*ids.shape, 1, dtype=torch.long)
    books = config_value(cfg, "num_codebooks")
    if name == "input_ids" and isinstance(books, int) and books > 1:
        _codebooks(model, kwargs, cfg, books, batch, seq, gen)
    langs = getattr(cfg, "languages", None)
    if "lang_ids" in params and isinstance(langs, (list, tuple)) and langs:
        # every row a language, as many of them as there are rows
        kwargs["lang_ids"] = torch.arange(batch) % len(langs)
    camera_images(model, kwargs, batch, gen)  # a policy's cameras (PI0)
    drawn_inputs(model, kwargs, batch, gen)  # the noise and time it would draw
    if text and Trials(model, {}).reads(kwargs) is None:
        # text the forward refuses beside its main input (Perceiver's ``input_ids`` is a
        # deprecated alias of its main input ``inputs``): the inputs go without it where they run
        without = {k: v for k, v in kwargs.items() if k not in ("input_ids", "image_embeds_position_mask")}
        if Trials(model, {}).reads(without) is not None:
            kwargs.clear()
            kwargs.update(without)


def _text_for_images(model, kwargs, params, cfg, batch, seq, gen, frames: int = 1) -> None:
    """Token ids for an image model that reads text too (see the module's docstring); a video's
    ``frames`` each take their own query tokens."""
    ids = token_ids(model, cfg, batch, seq, gen)
    n = config_value(cfg, "num_query_tokens", "latent_query_num")
    n = n * frames if isinstance(n, int) else n
    token = ints(config_value(cfg, "image_token_id", "image_token_index", "video_token_id", "video_token_index"))
    if isinstance(n, int) and n > 0 and (token or "image_embeds_position_mask" in params):
        # the image's embeddings after the first token, where the processor puts them
        fill = token[0] if token else int(ids[0, 0])
        ids = torch.cat([ids[:, :1], torch.full((batch, n), fill, dtype=ids.dtype), ids[:, 1:]], dim=1)
        if "image_embeds_position_mask" in params:
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[:, 1:1 + n] = True
            kwargs["image_embeds_position_mask"] = mask
    kwargs["input_ids"] = ids



def _codebooks(model, kwargs, cfg, books: int, batch: int, seq: int, gen) -> None:
    """Where the forward refuses a row of ids per example and runs on one per codebook
    (``batch × num_codebooks`` rows: MusicGen's decoder), the latter; else, where it runs on a
    column per stream a position (``batch × positions × streams``: Kyutai's text token and then
    one audio code per codebook, ``num_codebooks + 1``; the codebooks alone), the first such."""
    trials = Trials(model, kwargs)
    if trials.reads(kwargs) is not None:
        return
    ids = token_ids(model, cfg, batch * books, seq, gen)
    if trials.reads({**kwargs, "input_ids": ids}) is not None:
        kwargs["input_ids"] = ids
        return
    for k in (books + 1, books):
        ids = token_ids(model, cfg, batch * k, seq, gen).reshape(batch, k, seq).transpose(1, 2).contiguous()
        if trials.reads({**kwargs, "input_ids": ids}) is not None:
            kwargs["input_ids"] = ids
            return


def decoder_channels(model, kwargs: dict, cfg, batch: int, gen) -> None:
    """Where the forward refuses ``decoder_input_ids`` of one id a position and its decoder config
    states parallel streams (``num_channels``, ``num_codebooks``: Dia's nine channels of audio
    codes), ids of ``batch × positions × channels`` in range of the decoder's vocabulary, each
    channel starting at its start token, where the forward runs on them."""
    dec = kwargs.get("decoder_input_ids")
    sub = getattr(cfg, "decoder_config", None)
    k = config_value(sub, "num_codebooks", "num_channels") if sub is not None else None
    if dec is None or dec.dim() != 2 or not isinstance(k, int) or k < 2 or Trials(model, {}).reads(kwargs) is not None:
        return
    ids = token_ids(model, sub, batch * k, dec.shape[1], gen).reshape(batch, k, -1).transpose(1, 2).contiguous()
    start = ints(config_value(sub, "decoder_start_token_id", "bos_token_id"))
    ids[:, 0] = start[0] if start else dec[:, :1]
    trial = {**kwargs, "decoder_input_ids": ids}
    if Trials(model, {}).reads(trial) is not None:
        kwargs.update(trial)


def global_tokens(trials: Trials, params, batch: int) -> None:
    """The first token of each row attending globally (``global_attention_mask``), where the
    forward takes it and reads more parameters on it: Longformer's and LED's global query, key
    and value projections are read only on a branch that a token attending globally takes (their
    classification heads and summarisation examples mark the first token so)."""
    ids = trials.kwargs.get("input_ids")
    if "global_attention_mask" not in params or ids is None or ids.dim() != 2 or ids.shape[0] != batch:
        return
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1
    trials.offer({"global_attention_mask": mask})

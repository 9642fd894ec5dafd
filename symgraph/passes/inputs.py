"""Example inputs for a Hugging Face model, built from its config and its forward's signature
(no data): ``symgraph.analyze(model)`` needs no ``inputs=`` for any task transformers ships
that this module knows the main input of.

- token ids (``input_ids``) in range of the vocabulary, the config's own or its text
  config's (Gemma 3, Fuyu), avoiding every special token the config names (padding,
  end-of-sequence, image tokens); a sequence
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
- decoder inputs of an encoder-decoder (``decoder_input_ids``: its start token, then token
  ids; for a sequence classification head the ids shifted right, as its model would build);
- ``use_cache=False`` wherever the forward takes it; floating inputs in the model's dtype.

A diffusers model's example inputs come from :mod:`.diffusion_inputs`.
"""
from __future__ import annotations

import inspect

import torch

from ..errors import InputError
from .diffusion_inputs import diffusers_inputs, is_diffusers

__all__ = ["default_inputs", "is_hf"]


def is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _device(model) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _sub(cfg, *names):
    """The first of ``names`` set on ``cfg`` or, failing that, on its text / vision / audio
    sub-configs (in that order)."""
    for c in (cfg, *(getattr(cfg, k, None) for k in ("text_config", "vision_config", "audio_config",
                                                     "encoder", "encoder_config"))):
        for n in names:
            v = getattr(c, n, None) if c is not None and not isinstance(c, dict) else None
            if v is not None:
                return v
    return None


def _ints(v) -> list:
    v = v if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]


def _token_ids(model, cfg, batch, seq, gen):
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    if vocab is None:
        raise InputError(f"{type(model).__name__}'s config has no vocab_size (nor has its text config); "
                         "pass inputs=")
    maxpos = _sub(cfg, "max_position_embeddings", "n_positions")
    seq = min(seq, maxpos) if isinstance(maxpos, int) and maxpos > 0 else seq
    special = {i for c in (cfg, text) for k, v in vars(c).items()
               if k.endswith(("_token_id", "_token_index", "_token_ids")) for i in _ints(v)}
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or list(range(vocab)))
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=gen)]
    eos = _ints(_sub(cfg, "eos_token_id"))
    if getattr(cfg, "is_encoder_decoder", False) and type(model).__name__.endswith("ForSequenceClassification") and eos:
        ids[:, -1] = eos[0]  # the head reads the hidden state at the (one) end-of-sequence token
    return ids


def _pixels(model, cfg, batch, gen):
    size = _sub(cfg, "image_size") or 224
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    ch = _sub(cfg, "num_channels") or 3
    return torch.randn(batch, ch, *size, generator=gen)


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


def _samples(cfg, frames: int = 8, model=None) -> int:
    """Raw audio samples that leave ``frames`` frames after the feature extractor's convolutions."""
    kernels, strides = _ints(_sub(cfg, "conv_kernel") or []), _ints(_sub(cfg, "conv_stride") or [])
    n, convs = frames, list(zip(kernels, strides)) or _raw_convolutions(model)
    for k, s in reversed(convs):
        n = (n - 1) * s + k
    return n


def _features(model, cfg, batch, gen):
    mel, src = _sub(cfg, "num_mel_bins"), _sub(cfg, "max_source_positions")
    if mel and src:  # Whisper: channels first, twice the encoder's positions
        return torch.randn(batch, mel, 2 * src, generator=gen)
    feat = _sub(cfg, "input_feat_per_channel")
    if feat:  # Speech2Text: frames first
        return torch.randn(batch, 16, feat * (_sub(cfg, "input_channels") or 1), generator=gen)
    width = _sub(cfg, "feature_projection_input_dim") or mel
    if width:  # frames first (SeamlessM4T, Wav2Vec2-BERT; conformers: Parakeet, Canary), enough
        return torch.randn(batch, 8 * (_sub(cfg, "subsampling_factor") or 8), width, generator=gen)
    raise InputError(f"cannot tell the shape of {type(model).__name__}'s input_features from its config; pass inputs=")


def _image_tokens(model, kwargs, cfg, batch, gen) -> None:
    """A vision-language model with an image token: one image per row, its tokens after the
    first text token, as many as the model's own ``get_image_features`` returns for that image
    (features of the text's width: LLaVA, GOT-OCR 2), else as the config states (Gemma 3's
    ``mm_tokens_per_image``, ``image_seq_length``); text only where neither tells (the report
    then names a parameter the inputs never read)."""
    token = _ints(_sub(cfg, "image_token_id", "image_token_index"))
    vision = getattr(cfg, "vision_config", None)
    if not token or vision is None:
        return
    pixels = _pixels(None, vision, batch, gen)
    extra = {"image_sizes": torch.tensor([list(pixels.shape[-2:])] * batch)} if "image_sizes" in \
        inspect.signature(getattr(model, "get_image_features", _main)).parameters else {}
    n = _features_per_image(model, pixels, extra)
    n = n if n is not None else _sub(cfg, "mm_tokens_per_image", "image_seq_length")
    if not isinstance(n, int):
        return
    if n + 2 > (_sub(cfg, "max_position_embeddings") or 1 << 30):
        return
    ids = kwargs["input_ids"]
    text = ids[:, :max(2, ids.shape[1] - n)]
    image = torch.full((batch, n), token[0], dtype=ids.dtype)
    kwargs["input_ids"] = torch.cat([text[:, :1], image, text[:, 1:]], dim=1)
    kwargs["pixel_values"] = pixels
    kwargs.update(extra)


def _features_per_image(model, pixels, extra) -> int | None:
    """Image features per image that ``model.get_image_features`` returns for ``pixels`` (one
    image a row; and ``extra``: each image's size where it takes one, Mistral 3) (a list of
    per-image features or one tensor), each of the width of the model's input embeddings;
    None when it has none, refuses these pixels, or returns another width or an uneven count."""
    get, emb = getattr(model, "get_image_features", None), model.get_input_embeddings()
    width = getattr(emb, "embedding_dim", None)
    if get is None or not isinstance(width, int):
        return None
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    try:
        with torch.no_grad():
            out = get(pixel_values=pixels.to(_device(model), p.dtype if p is not None else pixels.dtype),
                      **{k: v.to(_device(model)) for k, v in extra.items()})
    except Exception:  # noqa: BLE001 - a tower that needs more than pixels (grids, sizes): text only
        return None
    feats = getattr(out, "pooler_output", None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
    feats = [feats] if isinstance(feats, torch.Tensor) else list(feats or ())
    if not feats or any(not isinstance(f, torch.Tensor) or f.shape[-1] != width for f in feats):
        return None
    total = sum(f.numel() for f in feats) // width
    return total // len(pixels) if total and total % len(pixels) == 0 else None


def _feature_mask(fn, feats, mel) -> dict:
    """An all-ones mask of the feature frames (the axis that is not ``mel`` channels wide),
    under the name ``fn`` takes it by, if any (``input_features_mask``, ``feature_attention_mask``)."""
    names = [n for n in inspect.signature(fn).parameters if "feature" in n and n.endswith("mask")]
    frames = feats.shape[2] if feats.shape[1] == mel else feats.shape[1]
    return {names[0]: torch.ones(feats.shape[0], frames, dtype=torch.long)} if names else {}


def _audio_tokens(model, kwargs, params, batch, gen) -> None:
    """A speech language model (Audio Flamingo 3, GLM-ASR) reads audio where its token ids
    hold its audio token: log-mel features of its audio config's shape (frames first, else
    channels first: the layout its own ``get_audio_features`` takes), and in each row as many
    audio tokens as that gives embeddings; text only where it takes neither (the report then
    names a parameter the inputs never read)."""
    cfg = model.config
    token, audio = _ints(_sub(cfg, "audio_token_id", "audio_token_index")), getattr(cfg, "audio_config", None)
    fn = getattr(model, "get_audio_features", None)
    if not token or audio is None or fn is None or "input_features" not in params:
        return
    try:
        feats = _features(model, audio, batch, gen).to(next(model.parameters()).dtype)
    except InputError:  # an audio config that does not tell its features' shape: text only
        return
    out, mel = None, _sub(audio, "num_mel_bins", "feature_size")
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
    width = _sub(cfg, "hidden_size")
    if not isinstance(emb, torch.Tensor) or not width or emb.numel() % (batch * width):
        return
    n, ids = emb.numel() // (batch * width), kwargs["input_ids"]
    kwargs["input_ids"] = torch.cat([ids[:, :1], torch.full((batch, n), token[0], dtype=ids.dtype), ids[:, 1:]], 1)
    kwargs["input_features"] = feats
    kwargs.update(masks)


def _passes_on(model, params, name: str) -> bool:
    """Whether the forward takes ``name``: by name, or in its ``**kwargs`` where a submodule's
    forward takes it by name (a CTC head hands them to its encoder)."""
    if name in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    return any(name in inspect.signature(m.forward).parameters for m in model.modules() if m is not model)


def _time_mask(model, kwargs, name, batch) -> None:
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


def _main(model, cfg, name, batch, seq, gen):
    if name == "input_ids":
        return _token_ids(model, cfg, batch, seq, gen)
    if name == "pixel_values":
        return _pixels(model, cfg, batch, gen)
    if name == "input_values":
        mel, frames = _sub(cfg, "num_mel_bins"), _sub(cfg, "max_length")
        if mel and isinstance(frames, int):  # a spectrogram (Audio Spectrogram Transformer)
            return torch.randn(batch, frames, mel, generator=gen)
        return torch.randn(batch, _samples(cfg, model=model), generator=gen)
    if name == "input_features":
        return _features(model, cfg, batch, gen)
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


def _encoder_states(model, kwargs, cfg, batch, gen) -> None:
    """A decoder used alone whose layers hold cross-attention (the causal LMs of BART, Pegasus,
    Marian) reads them only when given encoder states: four positions of its width, for a model
    its config says is a decoder (RoBERTa's masked LM takes them and ignores them), kept where
    its own forward runs on them (BERT as a decoder without cross-attention refuses them)."""
    width = _sub(cfg, "cross_attention_hidden_size", "encoder_hidden_size", "d_model", "hidden_size")
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    if not getattr(cfg, "is_decoder", False) or not isinstance(width, int) or p is None:
        return
    states = torch.randn(batch, 4, width, generator=gen)
    trial = {k: v.to(p.device) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            model(**trial, encoder_hidden_states=states.to(p.device, p.dtype),
                  **({"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}))
    except Exception:  # noqa: BLE001 - no cross-attention to read them: the inputs stay as they are
        return
    kwargs["encoder_hidden_states"] = states


def default_inputs(model, batch: int = 2, seq: int = 8):
    """Example inputs for a Hugging Face model, built from its config (no data needed); see the
    module's docstring; a diffusers model's: :mod:`.diffusion_inputs`. Returns ``(args, kwargs)``."""
    if is_diffusers(model):
        return diffusers_inputs(model)
    if not is_hf(model):
        raise InputError(
            f"{type(model).__name__} is not a Hugging Face model, so symgraph cannot build "
            "example inputs for it; pass inputs=(tensor, ...) positional inputs or a dict of "
            "keyword inputs.")
    cfg, dev = model.config, _device(model)
    params = inspect.signature(model.forward).parameters
    name, main_cfg = _main_input(model, params)
    gen = torch.Generator().manual_seed(0)
    kwargs = {name: _main(model, main_cfg, name, batch, seq, gen)}
    two_towers = getattr(cfg, "vision_config", None) is not None and _sub(
        cfg, "image_token_id", "image_token_index") is None
    if name == "input_ids" and "pixel_values" in params and two_towers:  # CLIP-like
        kwargs["pixel_values"] = _pixels(model, cfg.vision_config, batch, gen)
    elif name == "input_ids" and "pixel_values" in params:
        _image_tokens(model, kwargs, cfg, batch, gen)
    if name == "input_ids" and "input_features" in params:
        _audio_tokens(model, kwargs, params, batch, gen)
    if _passes_on(model, params, "mask_time_indices"):
        _time_mask(model, kwargs, name, batch)
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        start = _ints(_sub(cfg, "decoder_start_token_id", "pad_token_id"))
        ids = kwargs[name]
        if type(model).__name__.endswith("ForSequenceClassification") and name == "input_ids":
            dec = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)  # the ids shifted right
        else:
            dec = _token_ids(model, cfg, batch, max(2, seq // 2), gen)
        dec[:, 0] = start[0] if start else 0
        kwargs["decoder_input_ids"] = dec
        if name == "input_ids" and "attention_mask" in params:  # the encoder's: all ones (a
            # traced encoder stack makes none: LongT5's, Switch Transformers')
            kwargs["attention_mask"] = torch.ones_like(ids)
        if "decoder_attention_mask" in params:  # all ones: a decoder that would look for padding
            # in its ids otherwise branches on their values (FSMT), which no trace can follow
            kwargs["decoder_attention_mask"] = torch.ones_like(dec)
    elif name == "input_ids" and "encoder_hidden_states" in params:
        _encoder_states(model, kwargs, cfg, batch, gen)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kwargs = {k: v.to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in kwargs.items()}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (), kwargs

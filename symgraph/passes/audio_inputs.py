"""Audio for example inputs (see :mod:`.inputs`): raw samples, log-mel features, a speech
language model's audio and its audio tokens, masked time steps."""
from __future__ import annotations

import inspect

import torch
from torch.utils._pytree import tree_flatten

from ..errors import InputError
from .input_values import config_value, ints, token_ids
from .optional_inputs import Trials, parameter_reads

__all__ = ["audio_tokens", "drop_ignored", "features", "refused_audio", "samples", "time_mask"]


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
        return torch.randn(batch, mel, _windowed(cfg, 2 * src), generator=gen)
    feat = config_value(cfg, "input_feat_per_channel")
    if feat:  # Speech2Text: frames first
        return torch.randn(batch, 16, feat * (config_value(cfg, "input_channels") or 1), generator=gen)
    width = config_value(cfg, "feature_projection_input_dim") or _channels(cfg) or config_value(cfg, "input_dim")
    if width:  # frames first (SeamlessM4T, Wav2Vec2-BERT; conformers: Parakeet, Canary), enough
        return torch.randn(batch, 8 * (config_value(cfg, "subsampling_factor") or 8), width, generator=gen)
    raise InputError(f"cannot tell the shape of {type(model).__name__}'s input_features from its config; pass inputs=")


def _windowed(cfg, frames: int) -> int:
    """``frames`` cut to a whole number of the windows an audio encoder attends within
    (``n_window_infer`` frames: Qwen3-Omni's and Qwen3-ASR's), so that each window is as long as
    every other: transformers' export patch runs the windows as one batch, which needs that."""
    w = config_value(cfg, "n_window_infer")
    return frames // w * w if isinstance(w, int) and 0 < w <= frames else frames


def _channels(cfg) -> int | None:
    """The feature channels of a frame: the mel bins, times ``num_stacked_frames`` where the
    config stacks that many consecutive frames into one (low frame rate: Fun-ASR-Nano)."""
    mel = config_value(cfg, "num_mel_bins")
    return mel * (config_value(cfg, "num_stacked_frames") or 1) if isinstance(mel, int) else None


def _nested_value(cfg, *names):
    """The first of ``names`` set on ``cfg`` or on a config nested in it at any depth, breadth
    first (Nemotron 3.5 Transcribe: ``audio_config.asr_config.num_mel_bins``)."""
    queue, seen = [cfg], set()
    while queue:
        c = queue.pop(0)
        if c is None or isinstance(c, dict) or id(c) in seen:
            continue
        seen.add(id(c))
        got = next((getattr(c, n) for n in names if getattr(c, n, None) is not None), None)
        if got is not None:
            return got
        queue += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return None


def _feature_mask(fn, feats, mel) -> dict:
    """An all-ones mask of the feature frames (the axis that is not ``mel`` channels wide),
    under the name ``fn`` takes it by, if any (``input_features_mask``, ``feature_attention_mask``)."""
    names = [n for n in inspect.signature(fn).parameters if "feature" in n and n.endswith("mask")]
    frames = feats.shape[2] if feats.shape[1] == mel else feats.shape[1]
    return {names[0]: torch.ones(feats.shape[0], frames, dtype=torch.long)} if names else {}


def _extractor(model):
    """transformers' own feature extractor of the model's type (or of its audio config's), built
    with its defaults and the config's mel bins; None where transformers names none or it cannot
    be built here (a library it needs is not installed)."""
    import transformers
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES
    cfg = model.config
    kinds = (getattr(c, "model_type", None) for c in (cfg, getattr(cfg, "audio_config", None)))
    name = next((FEATURE_EXTRACTOR_MAPPING_NAMES[k] for k in kinds if k in FEATURE_EXTRACTOR_MAPPING_NAMES), None)
    mel = config_value(cfg, "num_mel_bins") or _nested_value(cfg, "num_mel_bins")
    try:
        cls = getattr(transformers, name)
        takes = inspect.signature(cls.__init__).parameters
        return cls(**({"feature_size": mel} if isinstance(mel, int) and "feature_size" in takes else {}))
    except Exception:  # noqa: BLE001 - none named, or a missing backend: the config's shape instead
        return None


def _extracted(fe, params, batch, gen) -> dict:
    """The extractor's tensors for half a second of random audio per row at its sampling rate,
    those the forward takes (its ``attention_mask`` under the forward's feature-mask name: the
    token ids keep their own)."""
    rate = int(getattr(fe, "sampling_rate", None) or 16000)
    wave = list((0.1 * torch.randn(batch, rate // 2, generator=gen)).numpy())
    out = None
    for extra in ({"return_attention_mask": True}, {}):
        try:
            out = fe(wave, sampling_rate=rate, return_tensors="pt", **extra)
            break
        except Exception:  # noqa: BLE001 - an extractor that takes no such option
            continue
    mask = next((n for n in params if "feature" in n and n.endswith("mask")), None)
    kw = {}
    for k, v in (out or {}).items():
        k = mask if k == "attention_mask" else k
        if k in params and isinstance(v, torch.Tensor):
            kw[k] = v.long() if v.dtype == torch.int32 else v
    return kw if any(v.is_floating_point() for v in kw.values()) else {}


def _padded(kw, factor, value) -> dict | None:
    """``kw`` with its feature frames (the mask's axis) padded on the right to a multiple of
    ``factor`` (``value`` in the features, 0 in the mask), as a processor pads for an encoder
    that subsamples by that factor (Nemotron 3.5 Transcribe); None where there is nothing to
    pad or the frames' axis is not plain."""
    mask = next((k for k, v in kw.items() if k.endswith("mask")), None)
    if not isinstance(factor, int) or factor < 2 or mask is None or -kw[mask].shape[-1] % factor == 0:
        return None
    n, out = kw[mask].shape[-1], {}
    for k, v in kw.items():
        axes = [d for d in range(1, v.dim()) if v.shape[d] == n]
        if len(axes) != 1:
            return None
        shape = list(v.shape)
        shape[axes[0]] = -n % factor
        fill = 0 if k == mask else value
        out[k] = torch.cat([v, torch.full(shape, fill, dtype=v.dtype)], axes[0])
    return out


def _layouts(model, cfg, params, batch, gen) -> list:
    """Candidate audio inputs: the feature extractor's, then log-mel features of the audio
    config's shape frames first and channels first (with an all-ones mask where taken)."""
    fe = _extractor(model)
    got = [kw for kw in ([_extracted(fe, params, batch, gen)] if fe is not None else []) if kw]
    factor = _nested_value(cfg, "subsampling_factor")
    out = [p for kw in got for p in (_padded(kw, factor, getattr(fe, "padding_value", 0.0)), kw) if p]
    audio = getattr(cfg, "audio_config", None) or getattr(cfg, "encoder_config", None)  # Granite Speech: the latter
    if "input_features" not in params or audio is None:
        return out
    try:
        feats = features(model, audio, batch, gen)
    except InputError:  # an audio config that does not tell its features' shape
        return out
    mel = config_value(audio, "num_mel_bins", "feature_size")
    # with an all-ones mask of the frames where the forward takes one, then without it (an
    # optional mask of something else: Granite Speech's masks its projected features)
    masked = [{"input_features": f, **_feature_mask(model.forward, f, mel)} for f in (feats, feats.transpose(1, 2))]
    return out + masked + [{"input_features": kw["input_features"]} for kw in masked if len(kw) > 1]


def refused_audio(model, kwargs, name, params, batch, gen) -> None:
    """A main audio input (``kwargs[name]``) the forward refuses at the config's shape, in place:
    what transformers' own feature extractor makes of half a second of random audio, where the
    forward runs on it (OmniASR's raw samples take a channel axis of one); else features as wide
    as the first linear map that reads their frames takes (Granite Speech 5's extractor stacks
    two frames of mel bins and their deltas, four times the config's bins, and needs torchaudio)."""
    trials = Trials(model, {})
    if trials.reads(kwargs) is not None:
        return
    fe = _extractor(model)
    got = _extracted(fe, params, batch, gen) if fe is not None else {}
    if name in got and trials.reads(got) is not None:
        kwargs.update(got)
        return
    x, width = kwargs[name], _reader_width(model, kwargs, name)
    wide = torch.randn(*x.shape[:-1], width, generator=gen) if width else None
    if wide is not None and trials.reads({**kwargs, name: wide}) is not None:
        kwargs[name] = wide


def _reader_width(model, kwargs, name) -> int | None:
    """The input width of the first ``nn.Linear`` the forward applies to a tensor with the frames
    of ``kwargs[name]`` (all its axes but the last), where that is not its width; None otherwise."""
    x, got = kwargs[name], list[int]()

    def pre(m, args):
        a = args[0] if args else None
        if not got and isinstance(a, torch.Tensor) and a.dim() == x.dim() and a.shape[:-1] == x.shape[:-1]:
            got.append(m.in_features)
    hooks = [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        Trials(model, {}).reads(kwargs)
    finally:
        for h in hooks:
            h.remove()
    return got[0] if got and got[0] != x.shape[-1] else None


def _counts(model, kw, batch) -> list:
    """Candidate numbers of audio tokens per row: as many as the model's own
    ``get_audio_features`` gives embeddings (one tensor, or one per clip), and each length its encoder's
    ``_get_feat_extract_output_lengths`` gives for the unmasked frames (or samples)."""
    # the model's own, or its base model's (MuseSpark's is on ``model.model``)
    out = []
    fn = getattr(model, "get_audio_features", None) \
        or getattr(getattr(model, "model", None), "get_audio_features", None)
    try:
        with torch.no_grad():
            emb = fn(**kw) if fn is not None else None
        emb = getattr(emb, "pooler_output", emb)  # embeddings of the text's width, last
        if isinstance(emb, (tuple, list)) and emb and all(isinstance(e, torch.Tensor) and e.dim() > 1 for e in emb):
            emb = torch.cat([e.reshape(-1, e.shape[-1]) for e in emb])  # one tensor per clip (Apertus 1.5)
        if isinstance(emb, torch.Tensor) and emb.dim() > 1 and emb[..., 0].numel() % batch == 0:
            out.append(emb[..., 0].numel() // batch)
    except Exception:  # noqa: BLE001 - it needs the token ids too, or other inputs: the lengths
        pass
    lengths = next((m._get_feat_extract_output_lengths for m in model.modules()
                    if hasattr(m, "_get_feat_extract_output_lengths")), None)
    mask = next((v for k, v in kw.items() if k.endswith("mask")), None)
    x = next((v for v in kw.values() if v.is_floating_point()), None)
    frames = mask.sum(-1)[:1] if mask is not None else torch.tensor([x.shape[-1], x.shape[1]]) if x is not None else None
    try:
        got = lengths(frames) if lengths is not None and frames is not None else ()
    except Exception:  # noqa: BLE001 - a lengths function of other inputs
        got = ()
    for v in got if isinstance(got, (tuple, list)) else (got,):
        out += [int(n) for n in torch.as_tensor(v).flatten().tolist()]
    return list(dict.fromkeys(n for n in out if n > 0))


def audio_tokens(model, kwargs, params, batch, gen) -> None:
    """A speech language model (Audio Flamingo 3, Qwen2-Audio, GLM-ASR, OmniASR) reads audio
    where its token ids hold its audio token: the audio its own feature extractor makes of half a
    second of random samples (else log-mel features of its audio config's shape, frames first or
    channels first), and in each row as many audio tokens as that gives embeddings (counted by
    its ``get_audio_features`` or its encoder's output lengths); the first of these its own
    forward runs on. Text only where none runs (the report then names a parameter the inputs
    never read).

    A model with no audio token whose forward refuses text alone adds each audio embedding to
    a token's (Voxtral Realtime: one token per embedding): token ids as many as the audio gives
    embeddings."""
    cfg = model.config
    token = ints(config_value(cfg, "audio_token_id", "audio_token_index"))
    if not any(p.is_floating_point() for p in model.parameters()):
        return
    if not token and Trials(model, {}).reads(kwargs) is not None:
        return  # text alone runs, and no token says where audio goes
    ids = kwargs["input_ids"]
    for kw in _layouts(model, cfg, params, batch, gen) + _codes(cfg, params, batch, gen):
        for n in _counts(model, kw, batch):
            run = torch.full((batch, n), token[0], dtype=ids.dtype) if token else None
            text = torch.cat([ids[:, :1], run, ids[:, 1:]], 1) if run is not None \
                else token_ids(model, cfg, batch, n, gen)
            trial = {**kwargs, **kw, "input_ids": text}
            if Trials(model, {}).reads(trial) is not None:  # the forward runs on them
                kwargs.update(trial)
                _no_sampling(kwargs, params)
                return


def _codes(cfg, params, batch, gen) -> list:
    """Discrete audio (``audio_input_ids``, frames of one code per codebook: Inkling's dMel
    bins): eight frames a row, each code in range of the audio config's ``codebook_size``, one per
    its ``num_codebooks``; none where the forward or the audio config does not tell."""
    audio = getattr(cfg, "audio_config", None)
    books = ints(config_value(audio, "num_codebooks")) if audio is not None else []
    size = ints(config_value(audio, "codebook_size")) if audio is not None else []
    if "audio_input_ids" not in params or not books or not size:
        return []
    return [{"audio_input_ids": torch.randint(0, size[0], (batch, 8, books[0]), generator=gen)}]


def _no_sampling(kwargs, params) -> None:
    """A forward that draws its audio latents at random unless told not to (VibeVoice's
    ``sample``, a flag on by default) is told not to: the example's output must be a function
    of its inputs, or no certificate can compare two runs."""
    flag = params.get("sample")
    if flag is not None and flag.default is True:
        kwargs["sample"] = False


def time_mask(model, kwargs, name, batch) -> None:
    """Time steps to mask (``mask_time_indices``, where the forward takes it: Wav2Vec2, HuBERT,
    SEW): every third frame after the feature extractor, so the program reads the masked
    frames' learned embedding (``masked_spec_embed``) as any input that masks would; dropped
    again where the forward ignores it (:func:`drop_ignored`)."""
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


def drop_ignored(model, kwargs: dict, name: str) -> None:
    """Drop ``kwargs[name]`` where a trial shows the forward ignores it: run with it and without,
    it reads the same parameters and returns the same values, bit for bit (SpeechT5's forward
    takes ``mask_time_indices`` in its ``**kwargs``, which :func:`.optional_inputs.passes_on`
    sees a module under it take, but hands it to none). Kept where either run refuses the
    inputs, or on ``meta``, where no value shows it."""
    if name not in kwargs:
        return
    outs: list = []
    run = lambda *a, **kw: outs.append(model(*a, **kw))  # noqa: E731
    reads = [parameter_reads(model, (), kw, run=run) for kw in (kwargs, {k: v for k, v in kwargs.items() if k != name})]
    if None in reads or reads[0] != reads[1] or len(outs) != 2:
        return
    (a, spec), (b, other) = (tree_flatten(o) for o in outs)
    a, b = ([t for t in x if isinstance(t, torch.Tensor)] for x in (a, b))
    if spec == other and len(a) == len(b) and all(
            not x.is_meta and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)):
        del kwargs[name]

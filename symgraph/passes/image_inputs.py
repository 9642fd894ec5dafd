"""Images for a vision-language model's example inputs (see :mod:`.inputs`): pixels and, in
each row of token ids, as many image tokens as the model's own tower returns features."""
from __future__ import annotations

import inspect
import math
import re

import torch

from ..errors import UnsizedOnMeta
from .image_processing import packed_patches, patch_grids, patch_rows, processed_images, tiles
from .input_values import config_value, device_of, ints, pixels
from .optional_inputs import Trials
from .tower_inputs import cross_attended, merged_patches, pooled_patches, temporal_patches

__all__ = ["features_per_image", "image_tokens", "tower_modes"]


def image_tokens(model, kwargs, cfg, batch, gen) -> None:
    """A vision-language model with an image token: one image per row, its tokens after the
    first text token, as many as the model's own ``get_image_features`` returns for that image
    (features of the text's width): plain pixels at the vision config's size (LLaVA, GOT-OCR 2),
    else what the model's own image processor makes of such an image (grids of patches: Qwen-VL;
    tiles and their masks: Idefics); else as the config states (Gemma 3's
    ``mm_tokens_per_image``, ``image_seq_length``); text only where none tells (the report then
    names a parameter the inputs never read), except on ``meta``, where a count the tower would
    give with values is refused (:class:`~symgraph.errors.UnsizedOnMeta`: a merge then loads
    its models rather than leave the tower unread and every class fixed). A mode of the tower that reads more parameters than
    the config's (:func:`tower_modes`: MiniCPM-OCR's ViT merger) is passed, with its own count."""
    token = ints(config_value(cfg, "image_token_id", "image_token_index"))
    # an encoder-decoder's vision config is its encoder's (T5Gemma 2); a model without one states
    # its patches itself (Fuyu)
    vision = config_value(cfg, "vision_config") or cfg
    if not token:
        return
    images, n = _counted(model, vision, batch, gen, lambda im, k: _runs(model, kwargs, token[0], im, k, batch))
    if n is not None:
        images, n = _mode_reading_more(model, kwargs, token[0], images, n, batch)
    n = n if n is not None else config_value(cfg, "mm_tokens_per_image", "image_seq_length")
    if not isinstance(n, int):
        if _image_features(model) is None:  # no tokens to count: images the text cross-attends to
            cross_attended(model, kwargs, vision, batch, gen)
        elif device_of(model).type == "meta":
            raise UnsizedOnMeta(
                f"{type(model).__name__} on the meta device: its get_image_features counts no features for "
                "any example image (a selection only the pixels decide, such as Idefics3's real images, cannot "
                "run without values), and text alone would leave its vision tower unread; expected the model "
                "with its weights")
        return
    if n + 2 > (config_value(cfg, "max_position_embeddings") or 1 << 30):
        return
    _insert(kwargs, token[0], n, batch)
    kwargs.update(images)
    _bounded(model, kwargs, cfg, n)
    _video_tokens(model, kwargs, cfg, images, batch, gen)
    marks = [k for k in inspect.signature(model.forward).parameters if k.endswith("mm_token_type_ids")]
    if marks:  # each token's modality, as transformers' processors mark it (multimodal RoPE reads
        # it; ERNIE-VL's mixture routes image tokens to its vision experts by moe_mm_token_type_ids)
        ids, video = kwargs["input_ids"], ints(config_value(cfg, "video_token_id", "video_token_index"))
        image = ids == token[0]  # (a video token that is the image token marks images: Molmo2's)
        kwargs.update(dict.fromkeys(marks, image.int() + 2 * ((ids == (video or [-1])[0]) & ~image).int()))
    _position_ids(model, kwargs)


def _bounded(model, kwargs, cfg, n: int) -> None:
    """Each row's image tokens between the config's image start and end tokens, where the
    forward refuses them without (Ovis 2.5 counts one boundary token of each per image, as its
    processor writes them, and adds its learned indicators there); unchanged otherwise."""
    start, end = (ints(config_value(cfg, k)) for k in ("image_start_token_id", "image_end_token_id"))
    if not (start and end) or Trials(model, {}).reads(kwargs) is not None:
        return
    ids = kwargs["input_ids"]
    rows = len(ids)
    bounded = torch.cat([ids[:, :1], torch.full((rows, 1), start[0], dtype=ids.dtype), ids[:, 1:1 + n],
                         torch.full((rows, 1), end[0], dtype=ids.dtype), ids[:, 1 + n:]], dim=1)
    trial = {**kwargs, "input_ids": bounded}
    if Trials(model, {}).reads(trial) is not None:
        kwargs.update(trial)


def _position_ids(model, kwargs) -> None:
    """Multimodal RoPE's positions (``position_ids``), computed by the model's own
    ``compute_3d_position_ids`` on these inputs: its Python loop over each token's modality
    (Qwen-VL, GLM-4V) branches on values no trace can follow; the positions are what the model
    computes itself, and depend on no parameter."""
    get = _features_getter(model, "compute_3d_position_ids")
    if get is None or "position_ids" not in inspect.signature(model.forward).parameters:
        return
    takes = inspect.signature(get).parameters
    args = {k: v for k, v in kwargs.items() if k in takes and k != "inputs_embeds"}
    try:
        with torch.no_grad():
            embeds = model.get_input_embeddings()(kwargs["input_ids"].to(device_of(model)))
            pos = get(**{k: v.to(device_of(model)) for k, v in args.items()}, inputs_embeds=embeds)
    except Exception:  # noqa: BLE001 - positions the forward computes itself, as it would
        return
    if isinstance(pos, torch.Tensor):
        kwargs["position_ids"] = pos.cpu()


def _insert(kwargs, token: int, n: int, batch: int, drop: bool = True) -> None:
    """``n`` tokens ``token`` in each row of ``input_ids``, after its first token, in place of
    as many of its last ones as leaves two text tokens (``drop``; else added: ids with image
    tokens already)."""
    ids = kwargs["input_ids"]
    text = ids[:, :max(2, ids.shape[1] - n)] if drop else ids
    image = torch.full((batch, n), token, dtype=ids.dtype)
    kwargs["input_ids"] = torch.cat([text[:, :1], image, text[:, 1:]], dim=1)


def _video_tokens(model, kwargs, cfg, images, batch, gen) -> None:
    """A video tower the images leave unread (Video-LLaVA's: ``get_video_features`` runs modules
    ``get_image_features`` does not): one video a row (``pixel_values_videos``, :func:`_video`)
    and as many video tokens as its features; nothing otherwise (a video through the image tower
    reads nothing new: Qwen-VL). A forward that runs on the video with no video token added puts
    its features on the image tokens (:func:`_on_image_tokens`)."""
    token = ints(config_value(cfg, "video_token_id", "video_token_index"))
    get = _features_getter(model, "get_video_features")
    if not token or get is None or "pixel_values_videos" not in inspect.signature(model.forward).parameters:
        return
    video = _video(model, cfg, images, batch, gen)
    if video is None:
        return
    seen_images, n_image = _modules_run(model, _image_features(model), images, batch)
    seen_videos, n = _modules_run(model, get, {"pixel_values_videos": video}, batch)
    if n is None or seen_videos <= seen_images:
        return
    if n == n_image and _on_image_tokens(model, kwargs, video):
        return
    if kwargs["input_ids"].shape[1] + n > (config_value(cfg, "max_position_embeddings") or 1 << 30):
        return
    _insert(kwargs, token[0], n, batch, drop=False)
    kwargs["pixel_values_videos"] = video


def _on_image_tokens(model, kwargs, video) -> bool:
    """Whether the forward runs on ``kwargs`` (one image a row, its tokens placed) with ``video``
    and no video token (then taken): its videos' placeholders are the image token's, and their
    features overwrite the images' on them (Nemotron-H Omni's: its forward reads no
    ``video_token_id``). No output then depends on a parameter only the images read (the patch
    projection of packed images): it moves with its classes, which the certificate judges on the
    images alone (tests/test_image_inputs_video.py), not on these inputs."""
    trial = {**kwargs, "pixel_values_videos": video}
    if Trials(model, {}).reads(trial) is None:
        return False
    kwargs.update(trial)
    return True


def _video(model, cfg, images, batch, gen):
    """One video a row: two frames of the images' size where they are 4-D (Video-LLaVA); else
    the shape the forward's docstring gives ``pixel_values_videos`` where it has five entries
    (Nemotron-H Omni's ``(num_videos, num_tubelets, video_temporal_patch_size * num_channels,
    height, width)``): one video a row, one tubelet (or frame), channels the product of the
    values the entry names (the vision config's, else the config's), frames as large as the
    first image's patch grid (an integer ``(num_images, 2 or 3)`` input: ``image_grid_hw``)
    times the vision config's patch size; None where neither tells."""
    px = images.get("pixel_values")
    if isinstance(px, torch.Tensor) and px.dim() == 4:
        return torch.randn(px.shape[0], 2, *px.shape[1:], generator=gen)
    shape = re.search(r"^\s*pixel_values_videos \(`[^`]*` of shape `\(([^)]*)\)`",
                      inspect.getdoc(model.forward) or "", re.M)
    dims = [d.strip() for d in shape.group(1).split(",")] if shape else []
    vision = config_value(cfg, "vision_config") or cfg
    channels = [getattr(vision, f.strip(), None) or getattr(cfg, f.strip(), None) for f in
                (dims[2].split("*") if len(dims) == 5 else ["-"])]
    grids = [v for k, v in images.items() if k.endswith("grid_hw") or k.endswith("grid_thw")]
    patch = getattr(vision, "patch_size", None)
    if len(dims) != 5 or not all(isinstance(c, int) for c in channels) or len(grids) != 1 \
            or not isinstance(patch, int) or grids[0].dim() != 2:
        return None
    height, width = (int(s) * patch for s in grids[0][0, -2:])
    own = torch.Generator()  # gen's draws stay as they were where the video is not taken
    own.set_state(gen.get_state())
    return torch.randn(batch, 1, math.prod(channels), height, width, generator=own)


def _modules_run(model, get, inputs: dict, batch: int = 1) -> tuple:
    """The modules of ``model`` that ``get(**inputs)`` runs, and its features per row (or None)."""
    seen, hooks = set(), [m.register_forward_hook(lambda m, a, o: seen.add(id(m))) for m in model.modules()]
    try:
        n = features_per_image(model, inputs, batch, get)
    finally:
        for h in hooks:
            h.remove()
    return seen, n


def _candidates(model, vision, batch, gen):
    """Candidate image inputs, in order: plain pixels, the model's own processor's, each layout's."""
    params = inspect.signature(model.forward).parameters
    yield _plain(model, vision, batch, gen)
    made = processed_images(model, vision, params, batch, gen)
    if made:
        yield made
    for layout in (patch_grids, tiles, patch_rows, merged_patches, packed_patches, temporal_patches, pooled_patches):
        yield from layout(vision, params, batch, gen)


def _counted(model, vision, batch, gen, runs) -> tuple:
    """The first of the candidate image inputs whose features ``get_image_features`` counts and
    on which (``runs(images, count)``) the forward runs, and that count per row; else the first
    counted (the trace then says why it fails); else plain pixels and None."""
    first = None
    for images in _candidates(model, vision, batch, gen):
        n = features_per_image(model, images, batch)
        if n is not None and runs(images, n):
            return images, n
        first = first or ((images, n) if n is not None else None)
    return first or (_plain(model, vision, batch, gen), None)


def _runs(model, kwargs, token: int, images: dict, n: int, batch: int) -> bool:
    """Whether the forward runs on ``kwargs`` with ``images`` and ``n`` image tokens a row (features
    counted per row that its placeholders cannot take are refused: NeoMME's patches, flat)."""
    return _reads(model, kwargs, token, images, n, batch) is not None


def _reads(model, kwargs, token: int, images: dict, n: int, batch: int):
    """The parameters the forward reads on ``kwargs`` with ``images`` and ``n`` image tokens a row
    (:meth:`.optional_inputs.Trials.reads`; None where it fails)."""
    trial = dict(kwargs)
    _insert(trial, token, n, batch)
    return Trials(model, {}).reads({**trial, **images})


def _mode_reading_more(model, kwargs, token: int, images: dict, n: int, batch: int) -> tuple:
    """``(images, n)`` with a mode of the image tower (:func:`tower_modes`) added where the forward
    runs on it, with its own count of image tokens, and reads a parameter it reads on none without
    (MiniCPM-OCR's default ``downsample_mode`` ``"4x"`` skips its ViT merger, which ``"16x"``
    runs); else as they are."""
    base = None
    for name, value in tower_modes(model):
        with_mode = {**images, name: value}
        k = features_per_image(model, with_mode, batch)
        more = _reads(model, kwargs, token, with_mode, k, batch) if k is not None else None
        base = _reads(model, kwargs, token, images, n, batch) if base is None and more is not None else base
        if more is not None and base is not None and more - base:
            return with_mode, k
    return images, n


def tower_modes(model) -> list:
    """``[(name, value)]``: each string keyword of ``get_image_features`` (the model's, its base
    model's) that the config states too (its default: MiniCPM-OCR's ``downsample_mode`` ``"4x"``),
    at each other value that the keyword's own entry in the method's docstring quotes as a string
    (`` `"16x"` ``), in order."""
    out: list = []
    for get in (getattr(model, "get_image_features", None),  # the base model's where the head's
                getattr(getattr(model, "model", None), "get_image_features", None)):  # passes *args on
        doc = (inspect.getdoc(get) or "") if get is not None else ""
        for name in inspect.signature(get).parameters if get is not None else ():
            default = getattr(model.config, name, None)
            entry = re.search(r"^[ \t]*%s \(`str`.*\n((?:[ \t]{6,}.*\n?)*)" % re.escape(name), doc, re.M)
            if isinstance(default, str) and entry is not None:
                out += [(name, v) for v in re.findall(r'`"([^"`]+)"`', entry.group(1)) if v != default]
    return list(dict.fromkeys(out))


def _plain(model, vision, batch, gen) -> dict:
    """Pixels at the vision config's size, and each image's size where ``get_image_features``
    takes one (Mistral 3)."""
    images = {"pixel_values": pixels(None, vision, batch, gen)}
    get = _image_features(model)
    if get is not None and "image_sizes" in inspect.signature(get).parameters:
        images["image_sizes"] = torch.tensor([list(images["pixel_values"].shape[-2:])] * batch)
    return images


def _features_getter(model, name: str):
    """The model's method ``name`` (``get_image_features``), or its base model's."""
    return getattr(model, name, None) or getattr(getattr(model, "model", None), name, None)


def _image_features(model):
    return _features_getter(model, "get_image_features")


def features_per_image(model, images: dict, batch: int, get=None) -> int | None:
    """Image features per row that the model's ``get_image_features`` returns for ``images``
    (its keyword inputs; one image a row) (a list of per-image features or one tensor), each of
    the width of the model's input embeddings or of its text's hidden states (factorised
    embeddings: NeoMME); None when it has none, refuses these images, or returns another width or
    an uneven count. ``get``: another such method (videos')."""
    get, emb = get or _image_features(model), model.get_input_embeddings()
    width = getattr(emb, "embedding_dim", None)
    text = getattr(model.config, "text_config", None) or model.config
    widths = {width, getattr(text, "hidden_size", None)}
    if get is None or not isinstance(width, int):
        return None
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    dev = device_of(model)
    args = {k: (v.to(dev, p.dtype) if v.is_floating_point() and p is not None else v.to(dev))
            if isinstance(v, torch.Tensor) else v for k, v in images.items()}  # a mode as it is
    try:
        with torch.no_grad():
            out = get(**args)
    except Exception:  # noqa: BLE001 - a tower that needs more than these inputs: text only
        return None
    feats = out if isinstance(out, (torch.Tensor, list, tuple)) else getattr(out, "pooler_output", None)
    if feats is None:  # the patches' embeddings are the features (Fuyu)
        feats = getattr(out, "last_hidden_state", None)
    feats = [feats] if isinstance(feats, torch.Tensor) else list(feats or ())
    if not feats or any(not isinstance(f, torch.Tensor) or f.shape[-1] not in widths for f in feats):
        return None
    width = feats[0].shape[-1]
    total = sum(f.numel() for f in feats) // width
    return total // batch if total and total % batch == 0 else None

"""Images for a vision-language model's example inputs (see :mod:`.inputs`): pixels and, in
each row of token ids, as many image tokens as the model's own tower returns features."""
from __future__ import annotations

import inspect

import torch

from .image_processing import patch_grids, processed_images, tiles
from .input_values import config_value, device_of, ints, pixels

__all__ = ["image_tokens"]


def image_tokens(model, kwargs, cfg, batch, gen) -> None:
    """A vision-language model with an image token: one image per row, its tokens after the
    first text token, as many as the model's own ``get_image_features`` returns for that image
    (features of the text's width): plain pixels at the vision config's size (LLaVA, GOT-OCR 2),
    else what the model's own image processor makes of such an image (grids of patches: Qwen-VL;
    tiles and their masks: Idefics); else as the config states (Gemma 3's
    ``mm_tokens_per_image``, ``image_seq_length``); text only where none tells (the report then
    names a parameter the inputs never read)."""
    token = ints(config_value(cfg, "image_token_id", "image_token_index"))
    vision = config_value(cfg, "vision_config")  # an encoder-decoder's: its encoder's (T5Gemma 2)
    if not token or vision is None:
        return
    images, n = _counted(model, vision, batch, gen)
    n = n if n is not None else config_value(cfg, "mm_tokens_per_image", "image_seq_length")
    if not isinstance(n, int):
        return
    if n + 2 > (config_value(cfg, "max_position_embeddings") or 1 << 30):
        return
    ids = kwargs["input_ids"]
    text = ids[:, :max(2, ids.shape[1] - n)]
    image = torch.full((batch, n), token[0], dtype=ids.dtype)
    kwargs["input_ids"] = torch.cat([text[:, :1], image, text[:, 1:]], dim=1)
    kwargs.update(images)


def _counted(model, vision, batch, gen) -> tuple:
    """The first of the candidate image inputs whose features ``get_image_features`` counts, and
    that count per row; else plain pixels and None."""
    params = inspect.signature(model.forward).parameters
    plain = _plain(model, vision, batch, gen)
    n = _features_per_image(model, plain, batch)
    if n is not None:
        return plain, n
    made = processed_images(model, vision, params, batch, gen)
    for images in [made] * bool(made) + patch_grids(vision, params, batch, gen) + tiles(vision, params, batch, gen):
        n = _features_per_image(model, images, batch)
        if n is not None:
            return images, n
    return plain, None


def _plain(model, vision, batch, gen) -> dict:
    """Pixels at the vision config's size, and each image's size where ``get_image_features``
    takes one (Mistral 3)."""
    images = {"pixel_values": pixels(None, vision, batch, gen)}
    get = _image_features(model)
    if get is not None and "image_sizes" in inspect.signature(get).parameters:
        images["image_sizes"] = torch.tensor([list(images["pixel_values"].shape[-2:])] * batch)
    return images


def _image_features(model):
    """The model's ``get_image_features``, or its base model's."""
    return getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None),
                                                                 "get_image_features", None)


def _features_per_image(model, images: dict, batch: int) -> int | None:
    """Image features per row that the model's ``get_image_features`` returns for ``images``
    (its keyword inputs; one image a row) (a list of per-image features or one tensor), each of
    the width of the model's input embeddings; None when it has none, refuses these images, or
    returns another width or an uneven count."""
    get, emb = _image_features(model), model.get_input_embeddings()
    width = getattr(emb, "embedding_dim", None)
    if get is None or not isinstance(width, int):
        return None
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    dev = device_of(model)
    args = {k: v.to(dev, p.dtype) if v.is_floating_point() and p is not None else v.to(dev)
            for k, v in images.items()}
    try:
        with torch.no_grad():
            out = get(**args)
    except Exception:  # noqa: BLE001 - a tower that needs more than these inputs: text only
        return None
    feats = getattr(out, "pooler_output", None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
    feats = [feats] if isinstance(feats, torch.Tensor) else list(feats or ())
    if not feats or any(not isinstance(f, torch.Tensor) or f.shape[-1] != width for f in feats):
        return None
    total = sum(f.numel() for f in feats) // width
    return total // batch if total and total % batch == 0 else None

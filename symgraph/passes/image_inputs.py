"""Images for a vision-language model's example inputs (see :mod:`.inputs`): pixels and, in
each row of token ids, as many image tokens as the model's own tower returns features."""
from __future__ import annotations

import inspect

import torch

from .input_values import config_value, device_of, ints, pixels

__all__ = ["image_tokens"]


def image_tokens(model, kwargs, cfg, batch, gen) -> None:
    """A vision-language model with an image token: one image per row, its tokens after the
    first text token, as many as the model's own ``get_image_features`` returns for that image
    (features of the text's width: LLaVA, GOT-OCR 2), else as the config states (Gemma 3's
    ``mm_tokens_per_image``, ``image_seq_length``); text only where neither tells (the report
    then names a parameter the inputs never read)."""
    token = ints(config_value(cfg, "image_token_id", "image_token_index"))
    vision = getattr(cfg, "vision_config", None)
    if not token or vision is None:
        return
    images = pixels(None, vision, batch, gen)
    get = getattr(model, "get_image_features", None)
    extra = {"image_sizes": torch.tensor([list(images.shape[-2:])] * batch)} \
        if get is not None and "image_sizes" in inspect.signature(get).parameters else {}
    n = _features_per_image(model, images, extra)
    n = n if n is not None else config_value(cfg, "mm_tokens_per_image", "image_seq_length")
    if not isinstance(n, int):
        return
    if n + 2 > (config_value(cfg, "max_position_embeddings") or 1 << 30):
        return
    ids = kwargs["input_ids"]
    text = ids[:, :max(2, ids.shape[1] - n)]
    image = torch.full((batch, n), token[0], dtype=ids.dtype)
    kwargs["input_ids"] = torch.cat([text[:, :1], image, text[:, 1:]], dim=1)
    kwargs["pixel_values"] = images
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
            out = get(pixel_values=pixels.to(device_of(model), p.dtype if p is not None else pixels.dtype),
                      **{k: v.to(device_of(model)) for k, v in extra.items()})
    except Exception:  # noqa: BLE001 - a tower that needs more than pixels (grids, sizes): text only
        return None
    feats = getattr(out, "pooler_output", None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
    feats = [feats] if isinstance(feats, torch.Tensor) else list(feats or ())
    if not feats or any(not isinstance(f, torch.Tensor) or f.shape[-1] != width for f in feats):
        return None
    total = sum(f.numel() for f in feats) // width
    return total // len(pixels) if total and total % len(pixels) == 0 else None

"""Pix2Struct-style flattened patches (``flattened_patches``: each patch's row and column, then
its ``C·P·P`` pixels, ``batch × patches × (2 + C·P·P)``) for a model whose forward takes them
(see :mod:`.inputs`): the main input of Pix2Struct, the images beside Kosmos-2.5's text. Made
by the image processor transformers names for the config's model type, its patch the side
whose pixels the vision config's patch embedding takes (``patch_embed_hidden_size`` = ``C·P·P``),
never from the model's name."""
from __future__ import annotations

import inspect
import math

import torch

from .image_processing import processor_class
from .input_values import config_value, ints

__all__ = ["PATCHES", "flattened_patches", "patch_side", "patches_beside_text"]

PATCHES = 16  # the patches of an example image: a 4 × 4 grid


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def patch_side(vision) -> int | None:
    """The side ``P`` of the square patches whose ``C·P·P`` pixels the vision config's patch
    embedding takes (``patch_embed_hidden_size``; ``C`` its channels, 3 unless stated); None
    where it states no such width."""
    width = _int(config_value(vision, "patch_embed_hidden_size"))
    ch = _int(config_value(vision, "num_channels")) or 3
    if width is None or width % ch:
        return None
    side = math.isqrt(width // ch)
    return side if side * side * ch == width else None


def flattened_patches(model, vision, batch: int, gen) -> torch.Tensor | None:
    """``batch`` images of :data:`PATCHES` patches each (fewer where the vision config allows
    fewer: ``seq_len``, ``max_num_patches``) as flattened patches: made by transformers' image
    processor for the model's type, patches of :func:`patch_side`, else laid out as it lays
    them (rows and columns numbered from 1, then the pixels); None where the patch size is not
    known."""
    side = patch_side(vision)
    if side is None:
        return None
    ch = _int(config_value(vision, "num_channels")) or 3
    n = min(PATCHES, _int(config_value(vision, "seq_len", "max_num_patches")) or PATCHES)
    grid = max(1, math.isqrt(n))
    cls = processor_class(str(getattr(model.config, "model_type", "")))
    images = [[torch.randint(0, 256, (grid * side, grid * side, ch), generator=gen, dtype=torch.uint8).numpy()]
              for _ in range(batch)]
    try:
        out = cls()(images, patch_size={"height": side, "width": side}, max_patches=grid * grid,
                    return_tensors="pt") if cls is not None else {}
    except Exception:  # noqa: BLE001 - a processor these settings do not fit: the layout by hand
        out = {}
    x = out.get("flattened_patches")
    if isinstance(x, torch.Tensor) and x.shape[-1] == 2 + ch * side * side:
        return x.float()
    rows = torch.arange(grid * grid) // grid + 1
    ids = torch.stack([rows, torch.arange(grid * grid) % grid + 1], dim=-1).float().expand(batch, -1, -1)
    return torch.cat([ids, torch.randn(batch, grid * grid, ch * side * side, generator=gen)], dim=-1)


def _image_rows(model, x: torch.Tensor, batch: int) -> int | None:
    """Image embeddings per row that the model's own ``get_image_features`` returns for the
    patches ``x`` (its pooled output: Kosmos-2.5's latent queries), None where it has none."""
    get = getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None),
                                                                  "get_image_features", None)
    if get is None:
        return None
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    try:
        with torch.no_grad():
            out = get(flattened_patches=x.to(p.device, p.dtype) if p is not None else x)
    except Exception:  # noqa: BLE001 - a tower these patches do not fit: none counted
        return None
    feats = getattr(out, "pooler_output", None)
    if not isinstance(feats, torch.Tensor) or feats.dim() != 3 or feats.shape[0] != batch:
        return None
    return int(feats.shape[1])


def patches_beside_text(model, kwargs: dict, cfg, batch: int, gen) -> None:
    """Where the main input is token ids and the forward also takes ``flattened_patches``
    (Kosmos-2.5): the patches, and after each row's first token as many positions as
    ``get_image_features`` returns embeddings (the config's ``latent_query_num`` where it has
    none), marked in ``image_embeds_position_mask`` where the forward takes it (as the model's
    processor places them); nothing where that would pass the text's positions."""
    params = inspect.signature(model.forward).parameters
    ids = kwargs.get("input_ids")
    if "flattened_patches" not in params or "flattened_patches" in kwargs \
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    x = flattened_patches(model, config_value(cfg, "vision_config") or cfg, batch, gen)
    if x is None:
        return
    n = _image_rows(model, x, batch) or _int(config_value(cfg, "latent_query_num", "num_query_tokens"))
    if n is None or n + ids.shape[1] > (_int(config_value(cfg, "max_position_embeddings")) or 1 << 30):
        return
    token = ints(config_value(cfg, "image_token_id", "image_token_index"))
    fill = torch.full((batch, n), token[0] if token else int(ids[0, 0]), dtype=ids.dtype)
    kwargs["input_ids"] = torch.cat([ids[:, :1], fill, ids[:, 1:]], dim=1)
    if "image_embeds_position_mask" in params:
        mask = torch.zeros_like(kwargs["input_ids"])
        mask[:, 1:1 + n] = 1
        kwargs["image_embeds_position_mask"] = mask
    kwargs["flattened_patches"] = x

"""Image inputs for vision towers the other layouts of :mod:`.image_processing` do not fit (see
:mod:`.image_inputs`, which tries each against the model's own ``get_image_features``), built
from the vision config and the forward's signature, never from the model's name."""
from __future__ import annotations

import inspect

import torch

from .image_processing import processed_images
from .input_values import config_value
from .optional_inputs import Trials

__all__ = ["cross_attended", "merged_patches", "pooled_patches", "temporal_patches"]


def _int(v) -> int | None:
    v = v[0] if isinstance(v, (list, tuple)) and v else v
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def merged_patches(vision, params, batch: int, gen) -> list:
    """Where the forward takes ``image_grid_thw`` counted in the text's image tokens (one per
    ``merge × merge`` patches: Inkling 2) rather than in patches: each row's image as a grid of
    ``2 × 2`` tokens, each token's pixels one small image of ``P·merge`` a side, channels last
    (``tokens × P·merge × P·merge × C``) or first; none without a patch and a merge size."""
    patch = _int(config_value(vision, "patch_size"))
    merge = _int(config_value(vision, "spatial_merge_size", "merge_size", "merge_kernel_size"))
    if "image_grid_thw" not in params or patch is None or merge is None or merge < 2:
        return []
    ch = _int(config_value(vision, "num_channels", "in_channels")) or 3
    side, n = patch * merge, 4 * batch
    grid = torch.tensor([[1, 2, 2]] * batch)
    return [{"pixel_values": torch.randn(*shape, generator=gen), "image_grid_thw": grid}
            for shape in ((n, side, side, ch), (n, ch, side, side))]


def temporal_patches(vision, params, batch: int, gen) -> list:
    """A tower that takes each patch as its own small clip, one text token each, with no grid
    (Inkling's, whose processor needs torchvision): four patches a row, each
    ``temporal_patch_size`` frames of ``P × P`` pixels, channels last (``T × P × P × C``) or
    first; none without a patch and a temporal patch size."""
    patch = _int(config_value(vision, "patch_size"))
    frames = _int(config_value(vision, "temporal_patch_size"))
    if patch is None or frames is None or "pixel_values" not in params:
        return []
    ch, n = _int(config_value(vision, "num_channels", "in_channels")) or 3, 4 * batch
    return [{"pixel_values": torch.randn(*shape, generator=gen)}
            for shape in ((n, frames, patch, patch, ch), (n, ch, frames, patch, patch))]


def pooled_patches(vision, params, batch: int, gen) -> list:
    """Where the forward takes the patches each image token pools (``image_token_pooling``:
    indices into every crop's patches, -1 a slot left empty) and each image's grid of tokens
    (``image_grids``: the low-resolution image's rows and columns, then its high-resolution
    crops'), as Molmo2's processor (which needs torchvision) makes them: each row's image one
    crop of ``(side / P)²`` patches of ``C·P·P`` values, its 2 × 2 tokens each pooling a 2 × 2
    block of patches, no high-resolution crops (``image_num_crops`` one each, where the forward
    takes it); none without a patch size."""
    patch, side = _int(config_value(vision, "patch_size")), _int(config_value(vision, "image_size"))
    if not {"image_token_pooling", "image_grids"} <= set(params) or patch is None or side is None:
        return []
    ch, s = _int(config_value(vision, "num_channels", "in_channels")) or 3, side // patch
    if s < 4:
        return []
    # a forward that takes each image's crop count indexes each image's own patches (it adds the
    # offsets); before it (transformers < 5.25) the indices ran over every image's patches
    local = "image_num_crops" in params
    blocks = [[(0 if local else b * s * s) + (r + i) * s + c + j for i in (0, 1) for j in (0, 1)]
              for b in range(batch) for r in (0, 2) for c in (0, 2)]
    crops = {"image_num_crops": torch.ones(batch, dtype=torch.long)} if local else {}
    return [{"pixel_values": torch.randn(batch, s * s, ch * patch * patch, generator=gen),
             "image_token_pooling": torch.tensor(blocks), "image_grids": torch.tensor([[2, 2, 0, 0]] * batch),
             **crops}]


def cross_attended(model, kwargs: dict, vision, batch: int, gen) -> None:
    """A model with an image token and no ``get_image_features`` to count its features by (its
    text cross-attends to the images: Mllama): the images its own image processor makes (tiles,
    their aspect ratios and masks), kept where the forward reads more parameters on them."""
    params = inspect.signature(model.forward).parameters
    images = processed_images(model, vision, params, batch, gen)
    if images:
        Trials(model, kwargs).offer(images)

"""Images made by a vision-language model's own image processor (see :mod:`.image_inputs`): the
processor transformers maps the config's ``model_type`` to, built with its defaults and sized to
the shrunk vision config where their settings share a name, run on small random images, one per
row; what it returns that the model's forward takes is the example's image inputs."""
from __future__ import annotations

from typing import Any

import torch

from .input_values import config_value

__all__ = ["image_side", "packed_patches", "patch_grids", "patch_rows", "processed_images", "processor_class",
           "tiles"]

# a processor's setting -> the vision config's names for it (transformers' own spellings)
_SETTINGS = {
    "patch_size": ("patch_size",),
    "merge_size": ("spatial_merge_size", "merge_size"),
    "temporal_patch_size": ("temporal_patch_size", "patch_temporal"),
}


def processor_class(model_type: str) -> Any:
    """The PIL image processor transformers names for ``model_type`` (the torchvision one needs
    a package this library does not require), or None."""
    try:
        from transformers.models.auto.image_processing_auto import (
            IMAGE_PROCESSOR_MAPPING_NAMES, get_image_processor_class_from_name)
    except Exception:  # pragma: no cover - an older transformers
        return None
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    name = names.get("pil") if isinstance(names, dict) else None
    return get_image_processor_class_from_name(name) if name else None


def _first_int(v):
    v = v[0] if isinstance(v, (list, tuple)) and v else v
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def image_side(vision) -> int | None:
    """The side of the square images the examples use: the vision config's ``image_size``, else
    two merged patches' worth of patches (a tower that takes any grid of patches: Qwen-VL)."""
    size = _first_int(config_value(vision, "image_size"))
    if size:
        return size
    patch = _first_int(config_value(vision, "patch_size"))
    merge = _first_int(config_value(vision, "spatial_merge_size", "merge_size", "merge_kernel_size")) or 1
    return 2 * merge * patch if patch else None


def _sized(value, side: int, factor: int | None = None):
    """``value`` (a size setting of the processor) for images of ``side``: each side it states;
    for a processor that merges patches (``factor``: patch × merge; Qwen-VL's smart resize) the
    shortest and longest edge are bounds on the pixel count: at least one merged patch, at most
    ``side²``, so the image is never enlarged."""
    keys = ("height", "width", "longest_edge", "shortest_edge")
    if isinstance(value, int) and not isinstance(value, bool):
        return side
    get = value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))
    stated = {k: side for k in keys if get(k) is not None}
    if factor and "longest_edge" in stated and "shortest_edge" in stated:
        return {"shortest_edge": factor * factor, "longest_edge": max(side * side, factor * factor)}
    return stated or None


def _merged_patch(proc) -> int | None:
    patch, merge = _first_int(getattr(proc, "patch_size", None)), _first_int(getattr(proc, "merge_size", None))
    return patch * merge if patch and merge else None


def configured_processor(model_type: str, vision, cfg=None):
    """The processor for ``model_type`` with its defaults, its patch / merge / temporal settings
    the vision config's, its sizes ``image_side`` and no splitting into tiles; a size of a second
    tower (``high_res_size``) that of ``cfg``'s config of that name (``high_res_vision_config``);
    None if none."""
    cls, side = processor_class(model_type), image_side(vision)
    if cls is None or side is None:
        return None
    proc = cls()
    for attr, names in _SETTINGS.items():
        n = _first_int(config_value(vision, *names))
        if n is not None and isinstance(getattr(proc, attr, None), int):
            setattr(proc, attr, n)
    for attr in ("size", "crop_size", "max_image_size"):
        v: Any = getattr(proc, attr, None)
        sized = _sized(v, side, _merged_patch(proc)) if v is not None else None
        if sized is not None:
            setattr(proc, attr, type(v)(**sized) if isinstance(sized, dict) and not isinstance(v, dict) else sized)
    for attr, v in list(vars(proc).items()):
        tower = getattr(cfg, attr[:-len("size")] + "vision_config", None) if attr.endswith("_size") else None
        other = _first_int(config_value(tower, "image_size")) if tower is not None else None
        sized = _sized(v, other) if other and v is not None else None
        if sized is not None:
            setattr(proc, attr, type(v)(**sized) if isinstance(sized, dict) and not isinstance(v, dict) else sized)
    for attr, v in list(vars(proc).items()):  # a list the config states by the same name: the
        stated = getattr(cfg, attr, None)     # tiles' resolutions (LLaVA-NeXT's image_grid_pinpoints)
        if isinstance(v, list) and isinstance(stated, list) and stated:
            setattr(proc, attr, [list(x) if isinstance(x, (list, tuple)) else x for x in stated])
    if getattr(proc, "do_image_splitting", None):
        proc.do_image_splitting = False
    return proc


def processed_images(model, vision, params, batch: int, gen) -> dict | None:
    """Image inputs for ``batch`` rows of one random image each, made by the model's own image
    processor (:func:`configured_processor`), kept where the forward (``params``) takes them; None
    when transformers has no such processor or it refuses these images."""
    proc = configured_processor(getattr(model.config, "model_type", ""), vision, model.config)
    side = image_side(vision)
    if proc is None:
        return None
    ch = _first_int(config_value(vision, "num_channels", "in_channels")) or 3
    images = [[torch.randint(0, 256, (int(side or 1), int(side or 1), ch), generator=gen, dtype=torch.uint8).numpy()]
              for _ in range(batch)]
    try:
        out = proc(images, return_tensors="pt")
    except Exception:  # noqa: BLE001 - a processor these settings do not fit: no images from it
        return None
    return {k: v for k, v in out.items() if k in params and isinstance(v, torch.Tensor)} or None


def patch_grids(vision, params, batch: int, gen) -> list:
    """Where the forward takes ``image_grid_thw`` and transformers has no processor this library
    can run (a torchvision-only one): each row's image as a grid of ``2·merge × 2·merge`` patches
    (one frame), its patches flattened (``C·T·P·P`` values each: Qwen-VL's layout), as small
    images (``C × P × P``) or as their pixels (``P·P`` rows of ``C`` each); the model's own
    ``get_image_features`` tells which it takes. A grid of rows and columns only
    (``image_grid_hw``: RADIO's tower in Nemotron-H Omni) has no frames."""
    patch = _first_int(config_value(vision, "patch_size"))
    if "image_grid_hw" in params and patch is not None and "image_grid_thw" not in params:
        return [{"pixel_values": g["pixel_values"], "image_grid_hw": g["image_grid_thw"][:, 1:]}
                for g in patch_grids(vision, {"image_grid_thw": None}, batch, gen)]
    if "image_grid_thw" not in params or patch is None:
        return []
    merge = _first_int(config_value(vision, "spatial_merge_size", "merge_size", "merge_kernel_size")) or 1
    frames = _first_int(config_value(vision, "temporal_patch_size", "patch_temporal")) or 1
    ch = _first_int(config_value(vision, "num_channels", "in_channels")) or 3
    grid = torch.tensor([[1, 2 * merge, 2 * merge]] * batch)
    n = batch * 4 * merge * merge
    shapes = ((n, ch * frames * patch * patch), (n, ch, patch, patch), (n * frames * patch * patch, ch))
    return [{"pixel_values": torch.randn(*shape, generator=gen), "image_grid_thw": grid} for shape in shapes]


def tiles(vision, params, batch: int, gen) -> list:
    """Where the forward takes ``pixel_attention_mask`` (Idefics' tiles, without a processor
    transformers maps the model to: ModernVBERT): one tile of ``image_side`` a row, every pixel
    real."""
    side = image_side(vision)
    if "pixel_attention_mask" not in params or side is None:
        return []
    ch = _first_int(config_value(vision, "num_channels", "in_channels")) or 3
    return [{"pixel_values": torch.randn(batch, 1, ch, side, side, generator=gen),
             "pixel_attention_mask": torch.ones(batch, 1, side, side, dtype=torch.bool)}]


def patch_rows(vision, params, batch: int, gen) -> list:
    """An image as rows of patches, ``C·P·P`` values each, ``(side / P)²`` of them: where the
    forward takes their grid (``spatial_shapes``, NaFlex: with a mask of real patches) and, for a
    tower that embeds patches by one linear map (Fuyu), alone, then every row's patches in one
    flat list (NeoMME)."""
    patch, side = _first_int(config_value(vision, "patch_size")), image_side(vision)
    if patch is None or side is None:
        return []
    ch = _first_int(config_value(vision, "num_channels", "in_channels")) or 3
    per_side = max(1, side // patch)
    rows = {"pixel_values": torch.randn(batch, per_side * per_side, ch * patch * patch, generator=gen)}
    if "spatial_shapes" not in params:
        return [rows, {"pixel_values": rows["pixel_values"].flatten(0, 1)}]
    return [{**rows, "spatial_shapes": torch.tensor([[per_side, per_side]] * batch),
             "pixel_attention_mask": torch.ones(batch, per_side * per_side, dtype=torch.bool)}]


def packed_patches(vision, params, batch: int, gen) -> list:
    """Where the forward takes ``target_sizes`` (NaViT-packed patches, as MiniCPM-V's processors
    make them, for a model whose processor needs torchvision: MiniCPM-OCR) and the vision config
    a patch size: every row's image a grid of ``g × g`` patches, all of them side by side in one
    ``C × P × (n·P)`` strip, and each image's grid; ``g`` the patches a side of ``image_side``
    (even: window and merge kernels take 2 × 2), then twice that."""
    patch, side = _first_int(config_value(vision, "patch_size")), image_side(vision)
    if "target_sizes" not in params or patch is None or side is None:
        return []
    ch = _first_int(config_value(vision, "num_channels", "in_channels")) or 3
    g = max(2, side // patch + side // patch % 2)
    return [{"pixel_values": torch.randn(1, ch, patch, batch * k * k * patch, generator=gen),
             "target_sizes": torch.tensor([[k, k]] * batch, dtype=torch.int32)} for k in (g, 2 * g)]

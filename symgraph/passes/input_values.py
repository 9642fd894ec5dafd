"""Values read from a Hugging Face config for example inputs (see :mod:`.inputs`): a setting
of the config or of its text / vision / audio sub-configs, token ids in range of the vocabulary,
images of the configured size, the device the model sits on."""
from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["config_value", "device_of", "ints", "pixels", "token_ids"]


def device_of(model) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def config_value(cfg, *names):
    """The first of ``names`` set on ``cfg`` or, failing that, on its text / vision / audio
    sub-configs (in that order)."""
    for c in (cfg, *(getattr(cfg, k, None) for k in ("text_config", "vision_config", "audio_config",
                                                     "encoder", "encoder_config"))):
        for n in names:
            v = getattr(c, n, None) if c is not None and not isinstance(c, dict) else None
            if v is not None:
                return v
    return None


def ints(v) -> list:
    v = v if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]


def token_ids(model, cfg, batch, seq, gen):
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None) or _rows(model) \
        or _tokenizer_vocab(cfg)
    if vocab is None:
        raise InputError(f"{type(model).__name__}'s config has no vocab_size (nor has its text config), and "
                         "neither its input embeddings nor its tokenizer tell one; pass inputs=")
    maxpos = config_value(cfg, "max_position_embeddings", "n_positions")
    seq = min(seq, maxpos) if isinstance(maxpos, int) and maxpos > 0 else seq
    special = {i for c in (cfg, text) for k, v in _named(c).items()
               if k.endswith(("_token_id", "_token_index", "_token_ids")) for i in ints(v)}
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or list(range(vocab)))
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=gen)]
    eos = ints(config_value(cfg, "eos_token_id"))
    if getattr(cfg, "is_encoder_decoder", False) and type(model).__name__.endswith("ForSequenceClassification") and eos:
        ids[:, -1] = eos[0]  # the head reads the hidden state at the (one) end-of-sequence token
    return ids


def _named(cfg) -> dict:
    """The config's settings, and those its ``attribute_map`` names (Molmo2's ``image_token_id``
    is its ``image_patch_id``)."""
    amap = getattr(type(cfg), "attribute_map", None)
    aliases = {a: getattr(cfg, a, None) for a in amap} if isinstance(amap, dict) else {}
    return {**vars(cfg), **aliases}


def _rows(model) -> int | None:
    """The rows of the model's input embeddings (a config that states no vocabulary)."""
    try:
        emb = model.get_input_embeddings()
    except Exception:  # noqa: BLE001 - a model that keeps none where transformers looks
        return None
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def _tokenizer_vocab(cfg) -> int | None:
    """The vocabulary of the tokenizer transformers names for the config's model type, where it
    is built with no files (CANINE's: Unicode code points), for a model that states no
    vocabulary in its config and has no input embeddings."""
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
        found = TOKENIZER_MAPPING_NAMES.get(str(getattr(cfg, "model_type", "")))
        names = list(found) if isinstance(found, (tuple, list)) else [found]
        return next(len(cls()) for n in names if n and (cls := tokenizer_class_from_name(n)) is not None)
    except Exception:  # noqa: BLE001 - none, or one that needs its files: no vocabulary known
        return None


def pixels(model, cfg, batch, gen):
    """Images of the size the config states (``image_size``; a detector's, which states none, its
    backbone's: LW-DETR's windows tile that image's patches, not any other), else 224 pixels."""
    size = config_value(cfg, "image_size") or config_value(getattr(cfg, "backbone_config", None), "image_size") \
        or 224
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    ch = config_value(cfg, "num_channels") or 3
    return torch.randn(batch, ch, *size, generator=gen)

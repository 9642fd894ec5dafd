"""Widths a family's model code divides by a number of its own (issue 65): read from the code
transformers ships for the config's family (``modeling_*`` beside its ``configuration_*``),
never from a table of family names."""
from __future__ import annotations

import math
import re

from .tower_sizes import is_int


def model_source(cfg) -> str:
    """The source of the modeling module transformers ships beside ``cfg``'s configuration
    module; "" when there is none."""
    import importlib
    import inspect
    name = type(cfg).__module__ if cfg is not None else ""
    if ".configuration_" not in name:
        return ""
    try:
        return inspect.getsource(importlib.import_module(name.replace(".configuration_", ".modeling_")))
    except Exception:  # noqa: BLE001 - no such module, or no source: nothing read
        return ""


def divided_widths(cfg, fields, out, source: str | None = None) -> dict:
    """A shrunk width the model code divides by a literal (``config.hidden_size // 6``: LiLT's
    layout embedding joins six such parts into a linear of width ``hidden_size``) that the
    default width is a multiple of and the shrunk one is not: the least common multiple of the
    shrunk width and every such literal (each divisor the shrink chose is kept: LiLT's 64 -> 192).
    ``source``: the model code (default: :func:`model_source`)."""
    code = model_source(cfg) if source is None else source
    res: dict = {}
    for key, d in re.findall(r"config\.(\w+)\s*//\s*(\d+)\b", code):
        d = int(d)
        old, new = fields.get(key), res.get(key, out.get(key))
        if d > 1 and key in out and is_int(old) and is_int(new) and new > 0 \
                and old % d == 0 and new % d != 0:
            res[key] = math.lcm(new, d)
    return res

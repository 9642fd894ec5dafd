"""The suite's result records as read back: the seed methods' current names for records
written under their former ones (``seed002`` ... before they were named after their papers)."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["FORMER_NAMES", "RENAME_NOTE", "renamed", "load_records"]

#: The seed methods' former names: result records written before they were named after their
#: papers (the committed ``benchmarks/results/*/results.json``) say these; :func:`renamed`
#: maps them when records are loaded, so old and new records read alike.
FORMER_NAMES = {"seed002": "verma2024", "seed003": "zhang2025", "seed003_rescale": "zhang2025_rescale",
                "seed004": "imfeld2024"}

#: The one line the report's tables carry about the renaming.
RENAME_NOTE = ("Seed methods are named after their papers: " + ", ".join(
    f"`{new}` (formerly `{old}`)" for old, new in FORMER_NAMES.items()) + ".")


def renamed(records) -> list:
    """``records`` with every former seed-method name (:data:`FORMER_NAMES`) replaced by its
    current one (records are copied where renamed, never changed in place)."""
    return [r | {"method": FORMER_NAMES[r["method"]]} if r.get("method") in FORMER_NAMES else r
            for r in records]


def load_records(path) -> list:
    """The records of a suite ``results.json``, under the current method names."""
    return renamed(json.loads(Path(path).read_text()))

"""The suite's result records as read back: records written under the seed methods' former names
(``seed002`` ..., the committed ``benchmarks/results/*/results.json``) read under the current ones."""
from __future__ import annotations

import json
from pathlib import Path

FORMER_NAMES = {"seed002": "verma2024", "seed003": "zhang2025", "seed003_rescale": "zhang2025_rescale",
                "seed004": "imfeld2024"}
#: The one line the report's tables carry about the renaming.
RENAME_NOTE = ("Seed methods are named after their papers: " + ", ".join(
    f"`{new}` (formerly `{old}`)" for old, new in FORMER_NAMES.items()) + ".")


def renamed(records) -> list:
    """``records`` under the current method names (renamed ones copied, never changed in place)."""
    return [r | {"method": FORMER_NAMES[r["method"]]} if r.get("method") in FORMER_NAMES else r
            for r in records]


def load_records(path) -> list:
    """The records of a suite ``results.json``, under the current method names."""
    return renamed(json.loads(Path(path).read_text()))

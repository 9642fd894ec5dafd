"""``symgraph rotate MODEL --out DIR``: :func:`symgraph.rotate` of a checkpoint, out of core.

The model is analysed on the meta device; each piece of it is then read, folded, rotated and
written on its own by the one writer of a moved checkpoint
(:func:`~symgraph.app.carry.carry_writer`, which writes B in A's basis too): one reader of a
norm with the norm's gain and shift (and the reader's bias), or one tensor no norm touches. A
piece larger than the memory budget whose rows no element moves (a vocabulary embedding, the
output head) is read and written in row slices, so no more than the budget is held (float64 while it is rotated, as in memory: the two give the
same values). The output has the input's keys, dtypes, sharding and config (with
``tie_word_embeddings`` false where untying freed the stream), and its record.
"""
from __future__ import annotations

import os
import time

from ..app.carry import carry_writer
from ..errors import InputError
from .classes import ones_gauge, rotation_classes, rotation_elements, rotation_report
from ..core.ties import untie_config_updates

__all__ = ["rotate_checkpoint"]


def rotate_checkpoint(model: str, out: str, *, how: str = "hadamard", seed: int = 0, memory_budget=None,
                      classes=("stream", "vo"), untie: bool = True, force: bool = False) -> dict:
    """Rotate the ``save_pretrained`` directory ``model`` into ``out`` out of core (see the
    module docstring); returns the record written beside it."""
    from ..checkpoints.outdir import check_out, save_atomic
    from ..checkpoints.sharded import Checkpoint, parse_size
    from .._version import __version__
    from ..checkpoints.inputs import check_paths, input_names
    if how not in ("hadamard", "random"):
        raise InputError(f"--how {how!r}; expected 'hadamard' or 'random' (learned rotations need data and "
                         "the model in memory: symgraph.rotate(model, how='learned', data=...))")
    budget = None if memory_budget is None else parse_size(memory_budget)
    out = check_out(out, force=force, inputs=[model])
    check_paths([model])
    if not os.path.isdir(os.path.expanduser(model)):
        raise InputError(f"{model!r} is not a local checkpoint directory; expected a save_pretrained directory "
                         "(symgraph rotate reads and writes checkpoints out of core)")
    t0 = time.time()
    ckpt = Checkpoint(os.path.expanduser(model))
    meta_model, report, untied = rotation_report(ckpt.model, untie=untie)
    if untied:
        ckpt = ckpt.untied(meta_model)
    roles = rotation_classes(report, classes)
    elements = rotation_elements(report, roles, how, seed)
    updates = untie_config_updates(ckpt.source.config if ckpt.source is not None else ckpt.config) if untied else {}
    record: dict = {"symgraph_rotate": {
        "symgraph_version": __version__, "model": input_names([model])[0], "how": how, "seed": seed,
        "classes": {r: ids for r, ids in roles.items()}, "untied": untied, "memory_budget": budget,
        "kinds": {str(g.id): g.kind for g in report.groups if any(g.id in ids for ids in roles.values())},
        "dtype": str(ckpt.dtype).removeprefix("torch."), "bytes_held": 0}}
    write = carry_writer(ckpt, report, elements, ones_gauge(report, dict.fromkeys(report.parameters)), budget=budget,
                         config_updates=updates, stats=record["symgraph_rotate"], what="rotated")
    save_atomic(write, out, force=force, inputs=[model], meta=record, tokenizer_from=ckpt.path,
                record="symgraph_rotate.json")
    record["symgraph_rotate"]["seconds"] = time.time() - t0
    record["out"] = out
    return record

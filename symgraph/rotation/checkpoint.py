"""``symgraph rotate MODEL --out DIR``: :func:`symgraph.rotate` of a checkpoint, out of core.

The model is analysed on the meta device; each piece of it is then read, folded, rotated and
written on its own: one reader of a norm with the norm's gain and shift (and the reader's
bias), or one tensor no norm touches. A piece larger than the memory budget whose rows no
element moves (a vocabulary embedding, the output head) is read and written in row slices, so
no more than the budget is held (float64 while it is rotated, as in memory: the two give the
same values). The output has the input's keys, dtypes, sharding and config (with
``tie_word_embeddings`` false where untying freed the stream), and its record.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from ..errors import InputError
from ..transform.apply import move_piece
from ..transform.folding import for_reader, members
from .classes import ones_gauge, rotation_classes, rotation_elements, rotation_report
from ..merging.untie import untie_config_updates

__all__ = ["rotate_checkpoint", "piece_bytes", "WORK_BYTES"]

#: Bytes held per element of a piece while it is rotated: the stored value, its float64 copy,
#: the folded, moved and unfolded float64 values.
WORK_BYTES = 40


def _keys(ckpt, name) -> list:
    return [k for k in ckpt.params.get(name, (name,)) if k in ckpt.shapes]


def _numel(report, name) -> int:
    n = 1
    for s in report.param_shape(name):
        n *= s
    return n


def pieces(report) -> list:
    """``[(fold, names, big)]``: each reader of a norm (its fold restricted to it) with the
    gain, shift and bias, then every other parameter or moved buffer alone (fold None);
    ``big`` is the piece's largest tensor (sliced by rows when it is over the budget and no
    element moves its rows)."""
    out: list = []
    done: set = set()
    for f in report.folds:
        for w, _, _ in f.readers:
            fr = for_reader(f, w)
            out.append((fr, members(fr), w))
            done.update(members(fr))
    for name in list(report.parameters) + list(report.buffers):
        if name not in done:
            out.append((None, (name,), name))
    return out


def _rows_free(report, elements, name) -> bool:
    if name in report.stacked or not report.param_shape(name):
        return False
    return report.axis_map(report.param_axes(name)[0], elements) is None


def piece_bytes(report, names) -> int:
    """Bytes a piece holds while it is rotated (:data:`WORK_BYTES` per element)."""
    return WORK_BYTES * sum(_numel(report, n) for n in names)


def _slices(report, elements, names, big, budget):
    """Row ranges of ``big`` to rotate at a time (one range: the whole piece)."""
    rows = report.param_shape(big)[0] if report.param_shape(big) else 1
    need = piece_bytes(report, names)
    if budget is None or need <= budget:
        return [(0, rows)], need
    if not _rows_free(report, elements, big):
        raise InputError(f"--memory-budget {budget} bytes is below the {need} bytes that rotating {big!r} "
                         f"(with {len(names) - 1} tensors it is folded with) needs; expected at least {need}")
    rest = need - piece_bytes(report, [big])
    per_row = piece_bytes(report, [big]) // rows
    step = (budget - rest) // max(per_row, 1)
    if step < 1:
        raise InputError(f"--memory-budget {budget} bytes cannot hold one row of {big!r} ({per_row + rest} "
                         f"bytes); expected at least {per_row + rest}")
    return [(a, min(a + step, rows)) for a in range(0, rows, step)], rest + step * per_row


def _sliced(report, f_names, big, name):
    """Whether ``name`` is read in the row slices of ``big`` (``big`` and a bias along its rows)."""
    if name == big:
        return True
    shape, bshape = report.param_shape(name), report.param_shape(big)
    return len(shape) == 1 and bool(bshape) and shape[0] == bshape[0] and name not in f_names


def _write_piece(ckpt, report, elements, piece, budget, writer, written, gauge):
    """Rotate and write one piece (in row slices of ``big`` where the budget asks); returns the
    bytes it held. A norm's gain and shift, shared by its readers, are written once."""
    fold, names, big = piece
    ranges, held = _slices(report, elements, names, big, budget)
    norm = {n for n in names if n in gauge}
    whole = len(ranges) == 1
    for a, b in ranges:
        cut = {n for n in names if not whole and _sliced(report, norm, big, n)}
        vals = {n: ckpt.get(n, part=(0, a, b) if n in cut else None) for n in names}
        new = move_piece(report, elements, vals, fold, {n: gauge[n] for n in names if n in gauge} or None)
        for n in names:
            if n not in cut and n in written:
                continue
            v = new[n].to(vals[n].dtype) if n in new else vals[n]
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise InputError(f"{n!r} is not finite in {v.dtype} once rotated; expected weights whose "
                                 "rotation stays in the dtype's range")
            for k in _keys(ckpt, n):
                writer.add(k, v)
            if n not in cut:
                written.add(n)
        written.update(cut if b == report.param_shape(big)[0] else ())
    return held


def _layout(ckpt) -> list:
    """``[(file name, [keys])]``: the shards of ``ckpt``, for the output to be split as the input was."""
    from ..checkpoints.sharded import SINGLE
    files: dict = {}
    for k in ckpt.keys:
        files.setdefault(os.path.basename(ckpt.files[k]), []).append(k)
    if len(files) == 1:
        return [(SINGLE, next(iter(files.values())))]
    return list(files.items())


def _writer(ckpt, report, elements, budget, config_updates, stats):
    from ..checkpoints.sharded import ShardWriter
    from ..merging.streaming import EXTRA_FILES

    def write(directory):
        gauge = ones_gauge(report, set(report.parameters))
        writer = ShardWriter(directory, None, [(k, ckpt.shapes[k], ckpt.dtypes[k]) for k in ckpt.keys],
                             layout=_layout(ckpt))
        written: set = set()
        for piece in pieces(report):
            stats["bytes_held"] = max(stats["bytes_held"], _write_piece(ckpt, report, elements, piece, budget,
                                                                        writer, written, gauge))
        stored = {k for n in written for k in _keys(ckpt, n)}
        for key in ckpt.keys:  # buffers no class moves, tensors the graph does not read
            if key not in stored:
                writer.add(key, ckpt.read(key, check=False))
        info = writer.close()
        with open(os.path.join(ckpt.path, "config.json")) as f:
            config = json.load(f)
        for k, v in config_updates.items():
            config[k] = {**config.get(k, {}), **v} if isinstance(v, dict) else v
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        for fn in EXTRA_FILES:
            if os.path.isfile(os.path.join(ckpt.path, fn)):
                shutil.copy2(os.path.join(ckpt.path, fn), os.path.join(directory, fn))
        return info
    return write


def rotate_checkpoint(model: str, out: str, *, how: str = "hadamard", seed: int = 0, memory_budget=None,
                      classes=("stream", "vo"), untie: bool = True, force: bool = False) -> dict:
    """Rotate the ``save_pretrained`` directory ``model`` into ``out`` out of core (see the
    module docstring); returns the record written beside it."""
    from ..checkpoints.outdir import check_out, save_atomic
    from ..checkpoints.sharded import Checkpoint, parse_size
    from .._version import __version__
    from ..app.run import check_paths, input_names
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
    write = _writer(ckpt, report, elements, budget, updates, record["symgraph_rotate"])
    save_atomic(write, out, force=force, inputs=[model], meta=record, tokenizer_from=ckpt.path,
                record="symgraph_rotate.json")
    record["symgraph_rotate"]["seconds"] = time.time() - t0
    record["out"] = out
    return record

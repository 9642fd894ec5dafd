"""Align once, merge anywhere: B carried into A's basis as a standard checkpoint.

:func:`run_align` (``symgraph align A B --out DIR``) solves the alignment of B to A (by
weights or activations, out of core where ``merge`` is) and writes B in A's basis: B's config,
B's dtypes, sharded like B, loadable by ``from_pretrained`` and mergeable by any tool
(mergekit's linear, SLERP, TIES/DARE against a base), plus the alignment itself
(``symgraph_alignment.safetensors``, see :mod:`symgraph.alignment.saved`).
:func:`run_apply` (``symgraph apply ALIGNMENT C --out DIR``) carries another checkpoint of B's
architecture the same way: a fine-tune of B shares B's basis, so one alignment of the
pre-trained models carries all of them. Both write through
:func:`~symgraph.checkpoints.outdir.save_atomic` (vetted before any work, atomic).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from ..errors import InputError
from ..transform.apply import move
from ..transform.folding import groups

__all__ = ["run_align", "run_apply", "carry_writer"]



def _layout(ckpt) -> list:
    """``[(file name, [keys])]``: the shards of ``ckpt``, for the output to be split (and
    named) as the input was."""
    from ..checkpoints.sharded import SINGLE
    files: dict = {}
    for k in ckpt.keys:
        files.setdefault(os.path.basename(ckpt.files[k]), []).append(k)
    if len(files) == 1:
        return [(SINGLE, next(iter(files.values())))]
    return list(files.items())


def carry_writer(ckpt, report, elements: dict, gauge: dict):
    """A function ``write(directory)`` writing ``ckpt`` moved by ``elements`` (with norm gains
    unfolded into ``gauge``'s) as a checkpoint with ``ckpt``'s keys, dtypes, config and
    sharding. One fold's tensors (a norm's gain and the layers reading it) are read, moved
    and written together; every other tensor alone. Maps act in float64, as
    :meth:`Alignment.apply` does in memory (so the two give the same values); each value is
    cast back to its own dtype."""
    from ..checkpoints.sharded import ShardWriter
    from ..merging.streaming import EXTRA_FILES
    unit = groups(report.folds)
    moved_buffers = set(report.buffers)

    def write(directory):
        order, seen = [], set()
        for key in ckpt.keys:
            if key in seen:
                continue
            name = ckpt.param_of.get(key)
            if name is None:  # a buffer: moved when a class moves it, else copied
                names = (key,) if key in moved_buffers else None
            else:
                names = unit.get(name, (name,))
            keys = (key,) if names is None else tuple(k for n in names for k in _keys(ckpt, n))
            order.append((keys, names))
            seen.update(keys)
        writer = ShardWriter(directory, None, [(k, ckpt.shapes[k], ckpt.dtypes[k]) for keys, _ in order for k in keys],
                             layout=_layout(ckpt))
        for keys, names in order:
            if names is None:
                writer.add(keys[0], ckpt.read(keys[0], check=False))
                continue
            vals = {n: ckpt.get(n) for n in names}  # checked finite
            new = move(report, elements, vals, {n: gauge[n] for n in names if n in gauge} or None)
            for n in names:
                v = new[n].to(vals[n].dtype) if n in new else vals[n]
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise InputError(f"{n!r} is not finite in {v.dtype} once carried into A's basis; expected "
                                     "an alignment whose maps keep the weights in the dtype's range")
                for k in _keys(ckpt, n):
                    writer.add(k, v)
        info = writer.close()
        shutil.copy2(os.path.join(ckpt.path, "config.json"), os.path.join(directory, "config.json"))
        for fn in EXTRA_FILES:
            if os.path.isfile(os.path.join(ckpt.path, fn)):
                shutil.copy2(os.path.join(ckpt.path, fn), os.path.join(directory, fn))
        return info
    return write


def _keys(ckpt, name) -> list:
    return [k for k in ckpt.params.get(name, (name,)) if k in ckpt.shapes]


def run_align(a: str, b: str, out: str, *, align: str = "weights", data: str | None = None, force: bool = False,
              fold_norms: bool = True, outputs=None, progress: bool = True) -> dict:
    """Align checkpoint ``b`` to ``a`` and write B in A's basis into ``out`` with the
    alignment (see the module docstring); returns the record written beside it."""
    from ..alignment.saved import ALIGNMENT_FILE, save_alignment
    from ..checkpoints.outdir import check_out, save_atomic
    from .run import _data, check_compatible, check_paths, input_names
    from .config import MergeConfig
    from ..merging.streaming import StreamingMerge
    from ..checkpoints.sharded import Checkpoint
    if align not in ("weights", "activations"):
        raise InputError(f"--align {align!r}; expected 'weights' or 'activations' (an alignment to save)")
    inputs = [a, b] + ([data] if data else [])
    out = check_out(out, force=force, inputs=inputs)
    check_paths([a, b])
    if data:
        from ..checkpoints.specs import DATA_EXPECTED
        from ..core.files import check_input_file
        check_input_file(data, "data file", DATA_EXPECTED)
    for p in (a, b):
        if not os.path.isdir(os.path.expanduser(p)):
            raise InputError(f"{p!r} is not a local checkpoint directory; expected save_pretrained directories "
                             "(symgraph align reads and writes checkpoints out of core)")
    ckpts = [Checkpoint(os.path.expanduser(p)) for p in (a, b)]
    check_compatible([c.config for c in ckpts], [a, b])
    if ckpts[0].shapes != ckpts[1].shapes:
        k = sorted(k for k in set(ckpts[0].shapes) | set(ckpts[1].shapes)
                   if ckpts[0].shapes.get(k) != ckpts[1].shapes.get(k))[0]
        raise InputError(f"{a!r} and {b!r} differ in tensor {k!r} ({ckpts[0].shapes.get(k)} vs "
                         f"{ckpts[1].shapes.get(k)}); symgraph align writes B in A's basis, which needs models "
                         "of one width (models of different widths merge with symgraph merge --align weights)")
    cfg = MergeConfig(models=[a, b], out=out, align=align, data=data, fold_norms=fold_norms, outputs=outputs)
    batches = _data(cfg, ckpts[0].model) if align == "activations" else None
    if align == "activations" and not batches:
        raise InputError("--align activations needs --data: a .safetensors or .pt file holding 'input_ids' [N, S]")
    t0 = time.time()
    job = StreamingMerge(ckpts, align=align, data=batches, fold_norms=fold_norms, outputs=outputs,
                         progress=progress)
    job.align()
    al = job.alignments[1]
    record: dict = {"symgraph_align": {"a": input_names([a])[0], "b": input_names([b])[0], "align": align,
                                 "data": os.path.abspath(data) if data else None, "fold_norms": fold_norms,
                                 "outputs": list(outputs) if outputs else None,
                                 "seconds_align": time.time() - t0, "alignment": ALIGNMENT_FILE,
                                 "dtype": str(ckpts[1].dtype).removeprefix("torch.")}}
    write = carry_writer(ckpts[1], al.report_b, al.elements, al.gauge)

    def writer(directory):
        info = write(directory)
        save_alignment(al, os.path.join(directory, ALIGNMENT_FILE))
        return info
    save_atomic(writer, out, force=force, inputs=inputs, meta=record, tokenizer_from=ckpts[1].path,
                record="symgraph_align.json")
    record["seconds"] = time.time() - t0
    record["out"] = out
    return record


def run_apply(alignment: str, model: str, out: str, *, force: bool = False) -> dict:
    """Carry checkpoint ``model`` (of the architecture and shapes of the B an alignment was
    solved for) into A's basis with the saved ``alignment``; writes ``out`` like
    :func:`run_align` (without the alignment file)."""
    from ..alignment.result import load_alignment
    from ..alignment.saved import fingerprint
    from ..checkpoints.outdir import check_out, save_atomic
    from ..checkpoints.sharded import Checkpoint
    from ..report.api import analyze
    from .run import check_paths, input_names
    out = check_out(out, force=force, inputs=[alignment, model])
    check_paths([model])
    al = load_alignment(alignment)
    if not os.path.isdir(os.path.expanduser(model)):
        raise InputError(f"{model!r} is not a local checkpoint directory; expected a save_pretrained directory")
    t0 = time.time()
    ckpt = Checkpoint(os.path.expanduser(model))
    report = analyze(ckpt.model, fold_norms=al.options.get("fold_norms", True), outputs=al.options.get("outputs"))
    if fingerprint(report) != al.fingerprints.get("b"):
        raise InputError(f"{model!r} has another symmetry structure than the model B the alignment {alignment!r} "
                         "was solved for (another architecture, width or config); expected a checkpoint of B's "
                         "architecture and shapes, e.g. a fine-tune of B")
    record: dict = {"symgraph_apply": {"alignment": os.path.abspath(os.path.expanduser(alignment)),
                                 "model": input_names([model])[0], "seconds": None,
                                 "dtype": str(ckpt.dtype).removeprefix("torch.")}}
    write = carry_writer(ckpt, report, al.elements, al.gauge)
    save_atomic(write, out, force=force, inputs=[alignment, model], meta=record, tokenizer_from=ckpt.path,
                record="symgraph_apply.json")
    record["symgraph_apply"]["seconds"] = time.time() - t0
    record["out"] = out
    return record


def read_record(directory: str) -> dict:
    """The record :func:`run_align` / :func:`run_apply` wrote beside a checkpoint."""
    from ..checkpoints.outdir import MARKER, record_of
    with open(os.path.join(directory, record_of(os.listdir(directory)) or MARKER)) as f:
        return json.load(f)

"""Align once, merge anywhere: B carried into A's basis as a standard checkpoint.

:func:`run_align` (``symgraph align A B --out DIR``) solves the alignment of B to A (by
weights or activations, out of core where ``merge`` is) and writes B in A's basis: B's config,
B's dtypes, sharded like B, loadable by ``from_pretrained`` and mergeable by any tool
(mergekit's linear, SLERP, TIES/DARE against a base), plus the alignment itself
(``symgraph_alignment.safetensors``, see :mod:`symgraph.alignment.saved`). A tied model and
its untied form (``symgraph rotate``'s output) are aligned through the tied one read untied; B
is then written untied, and ``apply`` reads a tied checkpoint untied where the alignment was
solved for B's untied form.
:func:`run_apply` (``symgraph apply ALIGNMENT C --out DIR``) carries another checkpoint of B's
architecture the same way: a fine-tune of B shares B's basis, so one alignment of the
pre-trained models carries all of them. Both write through
:func:`~symgraph.checkpoints.outdir.save_atomic` (vetted before any work, atomic).

:func:`carry_writer` is the one writer of a checkpoint moved by group elements, tensor by
tensor: B in A's basis here, a checkpoint rotated for quantization in
:mod:`symgraph.rotation.checkpoint` (row slices within a memory budget).
"""
from __future__ import annotations

import os
import time

import torch

from ..errors import InputError
from ..merging.engine.slicing import keys_of
from ..transform.apply import move_piece
from ..transform.folding import for_reader, members

__all__ = ["run_align", "run_apply", "carry_writer", "piece_bytes", "WORK_BYTES"]

#: Bytes held per element of a piece while it is moved: the stored value, its float64 copy,
#: the folded, moved and unfolded float64 values.
WORK_BYTES = 40


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
    """Bytes a piece holds while it is moved (:data:`WORK_BYTES` per element)."""
    return WORK_BYTES * sum(_numel(report, n) for n in names)


def _sizes(report, names, big) -> tuple:
    """``(rows of big, bytes of the whole piece, bytes besides big, bytes per row of big)``."""
    rows = report.param_shape(big)[0] if report.param_shape(big) else 1
    need, own = piece_bytes(report, names), piece_bytes(report, [big])
    return rows, need, need - own, max(own // rows, 1)


def _slices(report, names, big, budget):
    """Row ranges of ``big`` to move at a time (one range: the whole piece), within ``budget``,
    which :func:`carry_writer` checked against :func:`_least_bytes` before any work."""
    rows, need, rest, per_row = _sizes(report, names, big)
    if budget is None or need <= budget:
        return [(0, rows)], need
    step = (budget - rest) // per_row
    return [(a, min(a + step, rows)) for a in range(0, rows, step)], rest + step * per_row


def _least_bytes(report, elements, names, big) -> int:
    """The fewest bytes moving a piece takes: one row of ``big`` with the rest of the piece where
    no element moves its rows (:func:`_slices`), else the whole piece."""
    _, need, rest, per_row = _sizes(report, names, big)
    return rest + per_row if _rows_free(report, elements, big) else need


def _sliced(report, f_names, big, name):
    """Whether ``name`` is read in the row slices of ``big`` (``big`` and a bias along its rows)."""
    if name == big:
        return True
    shape, bshape = report.param_shape(name), report.param_shape(big)
    return len(shape) == 1 and bool(bshape) and shape[0] == bshape[0] and name not in f_names


def _write_piece(ckpt, report, elements, piece, writer, written, gauge, budget, what):
    """Move and write one piece (in row slices of ``big`` where the budget asks); returns the
    bytes it held. A norm's gain and shift, shared by its readers, are written once."""
    fold, names, big = piece
    ranges, held = _slices(report, names, big, budget)
    norm = {n for n in names if n in gauge}
    whole = len(ranges) == 1
    for a, b in ranges:
        cut = {n for n in names if not whole and _sliced(report, norm, big, n)}
        vals = {n: ckpt.get(n, part=(0, a, b) if n in cut else None) for n in names}  # checked finite
        new = move_piece(report, elements, vals, fold, {n: gauge[n] for n in names if n in gauge} or None)
        for n in names:
            if n not in cut and n in written:
                continue
            v = new[n].to(vals[n].dtype) if n in new else vals[n]
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise InputError(f"{n!r} is not finite in {v.dtype} once {what}; expected elements that keep the "
                                 "weights in the dtype's range")
            for k in keys_of(ckpt, n):
                writer.add(k, v)
            if n not in cut:
                written.add(n)
        written.update(cut if b == report.param_shape(big)[0] else ())
    return held


def carry_writer(ckpt, report, elements: dict, gauge: dict, *, budget: int | None = None,
                 config_updates: dict | None = None, stats: dict | None = None, what: str = "carried into A's basis"):
    """A function ``write(directory)`` writing ``ckpt`` moved by ``elements`` (with norm gains
    unfolded into ``gauge``'s) as a checkpoint with ``ckpt``'s keys, dtypes, config and
    sharding: one piece at a time (:func:`pieces`: each reader of a norm with the norm's gain and
    shift and its bias; every other parameter or moved buffer alone), the rest copied. A piece
    over ``budget`` bytes (:func:`piece_bytes`) whose rows no element moves is read and written
    in row slices. Maps act in float64, as :meth:`Alignment.apply` does in memory (so the two
    give the same values); each value is cast back to its own dtype. ``config.json`` is copied,
    or rewritten with ``config_updates``; ``stats["bytes_held"]``: the most a piece held;
    ``what``: the move, as refusals name it."""
    from ..checkpoints.sharded import CheckpointWriter, input_shards
    if budget is not None:  # the largest piece's least need, refused before any work (not piece by piece)
        floor, big = max((_least_bytes(report, elements, names, big), big) for _, names, big in pieces(report))
        if budget < floor:
            raise InputError(f"--memory-budget {budget} bytes is below the {floor} bytes that moving {big!r} "
                             f"needs at the least while {what}; expected at least {floor}")

    def write(directory):
        writer = CheckpointWriter(ckpt, directory, None, [(k, ckpt.shapes[k], ckpt.dtypes[k]) for k in ckpt.keys],
                                  config_updates, layout=input_shards(ckpt.keys, ckpt.files))
        written: set = set()
        for piece in pieces(report):
            held = _write_piece(ckpt, report, elements, piece, writer, written, gauge, budget, what)
            if stats is not None:
                stats["bytes_held"] = max(stats.get("bytes_held", 0), held)
        stored = {k for n in written for k in keys_of(ckpt, n)}
        for key in ckpt.keys:  # buffers no class moves, tensors the graph does not read
            if key not in stored:
                writer.add(key, ckpt.read(key, check=False))
        return writer.close()
    return write


def run_align(a: str, b: str, out: str, *, align: str = "weights", data: str | None = None, force: bool = False,
              fold_norms: bool = True, outputs=None, progress: bool = True, **engine) -> dict:
    """Align checkpoint ``b`` to ``a`` and write B in A's basis into ``out`` with the
    alignment (see the module docstring); returns the record written beside it. ``engine``:
    the merge engine's other options (``device``, ``memory_budget``, ``sketch``, ``tol``,
    ``max_iter``, ``until``, ``full_groups``: :class:`~symgraph.merging.config.MergeConfig`'s)."""
    from ..alignment.saved import ALIGNMENT_FILE, save_alignment
    from ..checkpoints.outdir import check_out, save_atomic
    from ..checkpoints.inputs import check_paths, input_names, read_batches
    from ..core.ties import untie_config_updates, untied_to_match
    from ..checkpoints.specs import check_same_configs
    from .config import MergeConfig
    from ..merging.streaming import StreamingMerge
    from ..checkpoints.sharded import Checkpoint, check_pair
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
    A, B, untied = untied_to_match(*(Checkpoint(os.path.expanduser(p)) for p in (a, b)))  # a tied model and
    ckpts = [A, B]  # its untied form: the tied one read untied (B then written untied)
    check_same_configs([c.config for c in ckpts], [a, b])
    check_pair(ckpts[0], ckpts[1], a, b, "symgraph align writes B in A's basis, which needs models of one width "
               "(models of different widths merge with symgraph merge --align weights)")
    cfg = MergeConfig(models=[a, b], out=out, align=align, data=data, fold_norms=fold_norms, outputs=outputs,
                      **engine)
    batches = read_batches(data, ckpts[0].model) if align == "activations" else None
    if align == "activations" and not batches:
        raise InputError("--align activations needs --data: a .safetensors or .pt file holding 'input_ids' [N, S]")
    t0 = time.time()
    job = StreamingMerge(ckpts, cfg, data=batches, progress=progress)
    job.align()
    al = job.alignments[1]
    record: dict = {"symgraph_align": {"a": input_names([a])[0], "b": input_names([b])[0], "align": align,
                                 "data": os.path.abspath(data) if data else None, "fold_norms": fold_norms,
                                 "outputs": list(outputs) if outputs else None, **engine,
                                 "seconds_align": time.time() - t0, "alignment": ALIGNMENT_FILE, "untied": untied,
                                 "dtype": str(ckpts[1].dtype).removeprefix("torch.")}}
    write = carry_writer(ckpts[1], al.report_b, al.elements, al.gauge,
                         config_updates=untie_config_updates((B.source or B).config) if "B" in untied else None)

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
    from ..core.ties import untie_config_updates
    from ..report.api import analyze
    from ..checkpoints.inputs import check_paths, input_names
    out = check_out(out, force=force, inputs=[alignment, model])
    check_paths([model])
    al = load_alignment(alignment)
    if not os.path.isdir(os.path.expanduser(model)):
        raise InputError(f"{model!r} is not a local checkpoint directory; expected a save_pretrained directory")
    t0 = time.time()
    ckpt = Checkpoint(os.path.expanduser(model))
    report = analyze(ckpt.model, fold_norms=al.options.get("fold_norms", True), outputs=al.options.get("outputs"))
    untied = fingerprint(report) != al.fingerprints.get("b") and any(len(v) > 1 for v in ckpt.params.values())
    if untied:  # a tied model, the alignment solved for its untied form (symgraph align beside a rotated model)
        ckpt = ckpt.untied()
        report = analyze(ckpt.model, fold_norms=al.options.get("fold_norms", True), outputs=al.options.get("outputs"))
    if fingerprint(report) != al.fingerprints.get("b"):
        raise InputError(f"{model!r} has another symmetry structure than the model B the alignment {alignment!r} "
                         "was solved for (another architecture, width or config); expected a checkpoint of B's "
                         "architecture and shapes, e.g. a fine-tune of B")
    record: dict = {"symgraph_apply": {"alignment": os.path.abspath(os.path.expanduser(alignment)),
                                 "model": input_names([model])[0], "seconds": None, "untied": untied,
                                 "dtype": str(ckpt.dtype).removeprefix("torch.")}}
    write = carry_writer(ckpt, report, al.elements, al.gauge,
                         config_updates=untie_config_updates((ckpt.source or ckpt).config) if untied else None)
    save_atomic(write, out, force=force, inputs=[alignment, model], meta=record, tokenizer_from=ckpt.path,
                record="symgraph_apply.json")
    record["symgraph_apply"]["seconds"] = time.time() - t0
    record["out"] = out
    return record

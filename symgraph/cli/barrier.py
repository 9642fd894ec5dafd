"""``symgraph barrier A B --data F``: does alignment help on *your* pair and data? The loss
on the data along the line between A and B, for each alignment asked for (none, weights,
activations), as a table, JSON and a plot; the barrier is ``max_λ L(λ) − ½(L(A) + L(B))``
(Verma & Elbayad 2024), in the parents' architecture or in circuit space (Theus et al. 2025).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

__all__ = ["cmd_barrier", "barrier_curves", "streamed_barrier_curves"]


def barrier_curves(A, B, data, aligns=("none", "weights"), points: int = 11, attention: str = "heads",
                   align_data=None, **options) -> list:
    """``[{"align", "curve": [(λ, loss)], "barrier", "seconds"}]``: the mean loss over ``data``
    (the model's own loss: language models use ``labels = input_ids``) at ``points`` values of
    λ from B (0) to A (1), with B aligned to A as each row says (activations measured on
    ``align_data``, default ``data``; ``options``: :func:`symgraph.align`'s, weight matching's
    ``sketch`` and ``tol`` for the weights row only)."""
    import torch

    from ..alignment.driver import align
    from ..alignment.refine import default_loss
    from ..evaluation.barrier import NO_LOSS, check_points, interpolate, loss_barrier
    points = check_points(points, "points=")

    def loss(m):
        with torch.no_grad():
            return float(sum(float(default_loss(m, b, "barrier", NO_LOSS)) for b in data) / len(data))
    if data:  # before any alignment: a model without a loss of its own is refused at once
        with torch.no_grad():
            default_loss(A, data[0], "barrier", NO_LOSS)

    rows, adata = [], align_data or data
    for how in aligns:
        t0 = time.perf_counter()
        Bal = B if how == "none" else align(A, B, adata[0], data=adata if how == "activations" else None,
                                            **row_options(how, options)).apply(B)
        curve = interpolate(A, Bal, np.linspace(0.0, 1.0, points), loss, attention=attention)
        rows.append({"align": how, "curve": curve, "barrier": loss_barrier(curve),
                     "midpoint": dict(curve).get(0.5), "seconds": time.perf_counter() - t0})
    return rows


def streamed_barrier_curves(A, B, data, aligns=("none", "weights"), points: int = 11, align_data=None,
                            **options) -> list:
    """:func:`barrier_curves` out of core: ``A``, ``B`` are checkpoints
    (:class:`~symgraph.checkpoints.sharded.Checkpoint`); the alignments are solved as
    ``symgraph merge`` solves them out of core and every point of the line runs the model's own
    program on tensors read and interpolated as each op takes them
    (:func:`~symgraph.evaluation.barrier.streamed_curve`): memory holds activations and a few
    layers' tensors, never a model. ``options``: the engine's (``symgraph merge``'s alignment
    options, ``device``, ``memory_budget``; ``sketch`` and ``tol`` for the weights row only)."""
    from ..evaluation.barrier import LossPrograms, check_points, loss_barrier, streamed_curve
    from ..merging.streaming import StreamingMerge
    points = check_points(points, "points=")
    programs = LossPrograms(A.model)
    if data:  # before any alignment: a model without a loss of its own is refused at once
        programs(data[0])
    rows = []
    for how in aligns:
        t0 = time.perf_counter()
        al = None
        if how != "none":
            job = StreamingMerge([A, B], align=how, data=(align_data or data) if how == "activations" else None,
                                 **row_options(how, options))
            job.align()
            al = job.alignments[1]
        curve = streamed_curve(A, B, data, np.linspace(0.0, 1.0, points), al, programs)
        rows.append({"align": how, "curve": curve, "barrier": loss_barrier(curve),
                     "midpoint": dict(curve).get(0.5), "seconds": time.perf_counter() - t0})
    return rows


def row_options(how: str, options: dict) -> dict:
    """The alignment ``options`` of one row: weight matching's ``sketch`` and ``tol`` only for
    the weights row (activation matching refuses them)."""
    return {k: v for k, v in options.items() if how == "weights" or k not in ("sketch", "tol")}


def _table(rows, attention) -> str:
    ends = dict(rows[0]["curve"])
    lines = [f"loss on the data: A {ends[1.0]:.4f}, B {ends[0.0]:.4f} ({attention})",
             f"{'align':<12} {'barrier':>8} {'L(0.5)':>8} {'seconds':>8}"]
    for r in rows:
        mid = "—" if r["midpoint"] is None else f"{r['midpoint']:.4f}"
        lines.append(f"{r['align']:<12} {r['barrier']:>8.4f} {mid:>8} {r['seconds']:>8.1f}")
    return "\n".join(lines)


def _plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for r in rows:
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", ms=3, label=f"{r['align']} (barrier {r['barrier']:.3f})")
    ax.set_xlabel("λ (0 = B, 1 = A)")
    ax.set_ylabel("loss on the data")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_barrier(args) -> int:
    from ..app.commands import BarrierCommand, engine_given, engine_options, read_command
    from ..checkpoints.inputs import check_paths, input_names
    from ..checkpoints.outdir import check_out, save_atomic
    cmd = read_command(vars(args), BarrierCommand)  # every option, before any work
    inputs = [args.a, args.b, cmd.data] + ([cmd.align_data] if cmd.align_data else [])
    if cmd.out:
        check_out(cmd.out, force=cmd.force, inputs=inputs)  # before any work
    check_paths([args.a, args.b])
    aligns, options = tuple(dict.fromkeys(cmd.align)), engine_options(cmd)
    rows = _streamed(args.a, args.b, cmd, aligns, options) if cmd.attention == "heads" else None
    mode = "out of core" if rows is not None else "in memory"
    if rows is None:
        _in_memory_only(engine_given(cmd))
        rows = _loaded(args.a, args.b, cmd, aligns, options)
    print(_table(rows, cmd.attention))
    if cmd.out:
        record = {"inputs": input_names([args.a, args.b]), "data": os.path.abspath(cmd.data),
                  "align_data": os.path.abspath(cmd.align_data) if cmd.align_data else None,
                  "attention": cmd.attention, "mode": mode, "options": options, "rows": rows}

        def write(d):
            with open(os.path.join(d, "barrier.json"), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            _plot(rows, os.path.join(d, "barrier.png"), f"{os.path.basename(str(args.a))} vs "
                  f"{os.path.basename(str(args.b))}")
        out = save_atomic(write, cmd.out, force=cmd.force, inputs=inputs, meta={"mode": "barrier"},
                          record="symgraph_barrier.json")
        print(f"wrote {out}/barrier.json and barrier.png")
    return 0


def _in_memory_only(engine: list) -> None:
    """Refuse the out-of-core engine's own options (``--device``, ``--memory-budget``) on the
    path that loads the models (``--attention circuits`` with them: the schema refuses)."""
    from ..errors import InputError
    if engine:
        raise InputError(f"{' and '.join(engine)} set the out-of-core engine, and the models are loaded (not two "
                         "save_pretrained directories read as stored, or too little memory); expected two "
                         f"save_pretrained directories, or no {' or '.join(engine)}")


def _loaded(a: str, b: str, cmd, aligns, options) -> list:
    """The rows with both models loaded (:func:`barrier_curves`)."""
    from ..checkpoints.specs import check_same_configs, check_same_family, load_data, load_model
    A, B = load_model(a), load_model(b)
    check_same_family([A, B], [a, b])
    check_same_configs([getattr(m, "config", None) for m in (A, B)], [a, b])  # the line runs in A's config
    data = load_data(cmd.data, A)
    adata = load_data(cmd.align_data, A) if cmd.align_data else None
    return barrier_curves(A, B, data, aligns, cmd.points, cmd.attention, adata, **options)


def _streamed(a: str, b: str, cmd, aligns, options):
    """The rows out of core when both models are local checkpoints whose tensors the model
    uses as stored and three float32 copies of a model would take over half the available
    memory (or ``--out-of-core``, ``--device`` or ``--memory-budget``); None (load them)
    otherwise, with a note when a graph needs the weights."""
    from ..app.commands import engine_given
    from ..checkpoints.sharded import check_pair
    from ..checkpoints.specs import load_data
    from ..core.progress import note
    from ..errors import NeedsMemory
    from ..merging.streaming import Checkpoint, KeysDiffer
    if not all(os.path.isdir(os.path.expanduser(p)) for p in (a, b)):
        return None
    try:
        A, B = (Checkpoint(os.path.expanduser(p)) for p in (a, b))
    except KeysDiffer:
        return None
    check_pair(A, B, a, b)
    if not cmd.out_of_core and not engine_given(cmd):  # in memory when A, B and the line's model fit easily
        from ..width.resize import available_memory
        need = 3 * 4 * sum(int(np.prod(shape, dtype=np.int64)) for shape in A.shapes.values())
        if need < available_memory() // 2:
            return None
    data = load_data(cmd.data, A.model)
    adata = load_data(cmd.align_data, A.model) if cmd.align_data else None
    try:
        return streamed_barrier_curves(A, B, data, aligns, cmd.points, adata, **options)
    except NeedsMemory as e:
        note(f"{e}, so the models are loaded in memory")
        return None


def add_parser(sub, debug_default):
    from ..app.commands import BarrierCommand
    from ..app.options import add_flags
    b = sub.add_parser("barrier", help="the loss along the line between two models, with and without "
                       "alignment (does alignment help on your pair and data?)")
    b.add_argument("a", help="model A (save_pretrained directory, demo name or hub id)")
    b.add_argument("b", help="model B, of A's architecture")
    add_flags(b, BarrierCommand)  # every option, from its declaration (merge's, where it shares one)
    b.add_argument("--debug", action="store_true", default=debug_default)
    b.set_defaults(func=cmd_barrier)
    return b

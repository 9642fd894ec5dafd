"""``symgraph compare A B [--data F] [--out DIR] [--json] [--out-of-core]``: is B a copy of A,
derived from it, or unrelated, up to every symmetry the graph admits
(:func:`symgraph.alignment.compare.compare`)? A few lines of verdict and evidence; ``--json``
prints the per-tensor numbers instead; ``--out`` writes them (compare.json) and a plot of the
per-layer similarity (compare.png).

Two ``save_pretrained`` directories are compared out of core (:func:`compare_checkpoints`)
when loading both would take over half the available memory, or with ``--out-of-core``: B is
aligned to A by the merge engine (:class:`~symgraph.merging.streaming.StreamingMerge`, full
groups fitted from the stored tensors) and read into A's basis tensor by tensor
(:class:`~symgraph.merging.engine.views.Aligned`); the shuffled copies of the null are read the same
way, so no model is ever whole in memory. The verdict is the same function's
(:func:`~symgraph.alignment.compare.judge`) on the same numbers. Models of different widths
(e.g. another ``intermediate_size``) are compared through the transport maps on both paths
(the engine aligns different widths by weights or activations); shapes that differ along an
axis no class maps are refused in one line naming the tensor."""
from __future__ import annotations

import copy
import gc
import os

__all__ = ["add_parser", "cmd_compare", "plot_layers", "layer_bars", "compare_checkpoints", "compare_paths"]


#: A bar's colour in compare.png: a layer that carries the verdict, and any other.
CARRIES, NOT_CARRYING = "tab:red", "tab:gray"


def layer_bars(res) -> list:
    """The bars of compare.png: ``(layer, excess, colour)`` of each layer with evidence (the median
    excess of its weight matrices over their null levels), painted :data:`CARRIES` only where it
    carries the verdict (so never when B is "unrelated" or "undetermined": a layer above the
    threshold is then no match)."""
    carried = res.verdict in ("same", "derived")
    return [(r["layer"], r["excess"], CARRIES if carried and r["carries"] else NOT_CARRYING)
            for r in res.layers if r["tensors"]]


def plot_layers(res, path: str, title: str = "") -> None:
    """Each layer's excess over the null (bars, :func:`layer_bars`: 0 is the shuffled copies' level,
    1 is A), and the threshold a layer needs to carry a "derived" verdict (line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = layer_bars(res)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(rows) + 2), 3.8))
    xs = range(len(rows))
    ax.bar(xs, [c for _, c, _ in rows], color=[colour for _, _, colour in rows])
    ax.axhline(0.0, color="k", lw=0.8, ls=":", label="null (shuffled B)")
    ax.axhline(res.threshold, color="tab:blue", lw=0.8, ls="--", label=f"derived needs {res.threshold:g}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([name for name, _, _ in rows], rotation=60, ha="right", fontsize=6)
    ax.set_ylim(min(0.0, min((c for _, c, _ in rows), default=0.0)) - 0.02, 1.02)
    ax.set_ylabel("excess over the null (A: 1)")
    ax.set_title(f"{title}: {res.verdict}" if title else res.verdict, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shuffled_checkpoint(ckpt, names, seed: int, draw: int):
    """``ckpt`` read with the entries of each parameter of ``names`` permuted as
    :func:`~symgraph.alignment.compare.shuffled` permutes them in memory (a view: the files
    are not touched)."""
    from ..alignment.compare import shuffled
    view, want, read = copy.copy(ckpt), set(names), ckpt.read

    def read_shuffled(key, check=True, part=None):
        p = ckpt.param_of.get(key)
        if p not in want:
            return read(key, check, part)
        t = shuffled(read(key, check), seed, draw, p)
        return t if part is None else t.narrow(part[0], part[1], part[2] - part[1]).clone()
    view.read = read_shuffled
    return view


def _widths(A, B, a: str, b: str, names) -> dict:
    """Refuse two :class:`~symgraph.checkpoints.sharded.Checkpoint` s of different classes,
    tensors or tensor ranks; ``{parameter: (A's shape, B's shape)}`` of ``names`` whose widths
    differ."""
    from ..alignment.compare import shape_differences
    from ..errors import InputError
    if A.cls is not B.cls:
        raise InputError(f"{a!r} is a {A.cls.__name__} but {b!r} is a {B.cls.__name__}; expected two models "
                         "of one architecture")
    shape_differences(A.shapes, B.shapes, f"{a!r} and {b!r}")
    return {n: (tuple(A.shapes[A.key(n)]), tuple(B.shapes[B.key(n)])) for n in names
            if tuple(A.shapes[A.key(n)]) != tuple(B.shapes[B.key(n)])}


def compare_checkpoints(A, B, data=None, *, null: int = 4, threshold: float | None = None,
                        alpha: float | None = None, seed: int = 0, fold_norms: bool = True, memory_budget=None,
                        **engine):
    """:func:`~symgraph.alignment.compare.compare` out of core: ``A``, ``B`` are
    :class:`~symgraph.checkpoints.sharded.Checkpoint` s (or ``save_pretrained`` directories).
    Each alignment (B's, then each shuffled copy's) is the merge engine's
    (``memory_budget``: as ``symgraph merge --memory-budget``), and each tensor of B in A's
    basis is read, moved and measured one at a time. Rotations are solved and applied in
    float64 for 32- and 64-bit checkpoints (as in memory: the same numbers), in float32 for
    16-bit ones (as the engine merges them). ``engine``: the engine's other options
    (``device``, weight matching's ``sketch``: ``symgraph merge``'s)."""
    import torch

    from ..alignment.compare import (ALPHA, THRESHOLD, check_aligned, check_options, gauge_names, judge, measure,
                                     tolerance, width_refusal)
    from ..core.finite import batch_list
    from ..core.ties import untied_to_match
    from ..errors import InputError, StructureMismatchError
    from ..merging.streaming import Checkpoint, StreamingMerge
    threshold = THRESHOLD if threshold is None else threshold
    alpha = ALPHA if alpha is None else alpha
    check_options(null, threshold)
    A, B = (c if isinstance(c, Checkpoint) else Checkpoint(os.path.expanduser(c)) for c in (A, B))
    A, B, untied = untied_to_match(A, B)
    names = [n for n, p in A.model.named_parameters() if p.is_floating_point()]
    widths = _widths(A, B, A.path, B.path, names)
    data = batch_list(data, A, B)
    dtypes = {c.dtypes[c.key(n)] for c in (A, B) for n in names}
    work = torch.float32 if dtypes & {torch.float16, torch.bfloat16} else torch.float64
    gauge: set = set()

    def solve(draw):
        Bv = B if draw is None else _shuffled_checkpoint(B, [n for n in names if n not in gauge], seed, draw)
        job = StreamingMerge([A, Bv], align="weights" if data is None else "activations", data=data,
                             fold_norms=fold_norms, memory_budget=memory_budget, full_groups=True,
                             work_dtype=work, **engine)  # what rotations are applied in (solved in float64 unless both are 16-bit)
        try:
            al = job.align()[1]
        except StructureMismatchError as e:
            raise (width_refusal(widths, e, f"{A.path!r} and {B.path!r}") if widths else e) from None
        if draw is None:
            gauge.update(gauge_names(job.report))
        view = job.aligned(1)

        def read_b(n, fetch=view.fetch):  # B's tensor in A's basis, refused unless in A's shape
            t = fetch(n)
            check_aligned(n, t.shape, A.shapes[A.key(n)], f"{A.path!r} and {B.path!r}")
            return t
        try:
            return al, measure(A.get, read_b, names, gauge)
        finally:
            view.clear()
            del job, view, read_b
            gc.collect()  # the engine's reference cycles, before the next draw's alignment

    res = judge(solve, tolerance(*dtypes), null=null, threshold=threshold, alpha=alpha,
                similarity="weights" if data is None else "activations", widths=widths)
    res.mode, res.untied = "out of core", untied
    return res


def _checkpoints(a: str, b: str, out_of_core: bool | None):
    """The two checkpoints when they are compared out of core (both local directories whose
    tensors the model uses as stored, and ``out_of_core`` or three float32 copies of a model
    over half the available memory); None: load them."""
    import numpy as np

    from ..core.progress import note
    from ..merging.streaming import Checkpoint, KeysDiffer
    if out_of_core is False or not all(os.path.isdir(os.path.expanduser(p)) for p in (a, b)):
        if out_of_core:
            note("--out-of-core needs two save_pretrained directories; the models are loaded in memory")
        return None
    try:
        A, B = (Checkpoint(os.path.expanduser(p)) for p in (a, b))
    except KeysDiffer:
        if out_of_core:
            note("transformers renames these checkpoints' tensors on load; the models are loaded in memory")
        return None
    from ..core.ties import untied_to_match
    loose_a, loose_b, _ = untied_to_match(A, B)  # a tied model and its untied form: compared untied
    _widths(loose_a, loose_b, a, b, ())
    if not out_of_core:
        from ..width.resize import available_memory
        need = 3 * 4 * sum(int(np.prod(shape, dtype=np.int64)) for shape in A.shapes.values())
        if need < available_memory() // 2:
            return None
    return A, B


def compare_paths(a: str, b: str, data: str | None = None, *, null: int = 4, seed: int = 0,
                  out_of_core: bool | None = None, fold_norms: bool = True, **engine):
    """What ``symgraph compare A B`` computes: the :class:`~symgraph.alignment.compare.Comparison`
    of model specs ``a`` and ``b`` (``save_pretrained`` directories, demo names, hub ids; ``data``:
    a file of batches), out of core or in memory (``out_of_core``: None decides by size, True
    asks for it, False loads the models); ``.mode`` says which. ``engine``: options only the
    out-of-core engine takes (``device``, ``memory_budget``, ``sketch``): given, they compare out
    of core, or are refused when the models cannot be read so."""
    from ..alignment.compare import compare
    from ..checkpoints.specs import load_data, load_model
    from ..errors import InputError
    from ..checkpoints.inputs import check_paths
    from ..alignment.compare import THRESHOLD, check_options
    from ..core.schema import SEED
    check_options(null, THRESHOLD, "--null")
    SEED.check(seed, "--seed")
    check_paths([a, b])
    ckpts = _checkpoints(a, b, True if engine else out_of_core)
    if ckpts is not None:
        ca, cb = ckpts
        return compare_checkpoints(ca, cb, load_data(data, ca.model) if data else None, null=null, seed=seed,
                                   fold_norms=fold_norms, **engine)
    if engine:
        from ..app.commands import CompareCommand
        from ..core.schema import flag
        said = " and ".join(flag(CompareCommand, k) for k in engine)
        raise InputError(f"{said} set the out-of-core engine, and these models are loaded (not two "
                         f"save_pretrained directories read as stored); expected those, or no {said}")
    A, B = load_model(a), load_model(b)
    if type(A) is not type(B):
        raise InputError(f"{a!r} is a {type(A).__name__} but {b!r} is a {type(B).__name__}; "
                         "expected two models of one architecture")
    return compare(A, B, load_data(data, A) if data else None, null=null, seed=seed, fold_norms=fold_norms)


def cmd_compare(args) -> int:
    from ..app.commands import CompareCommand, engine_options, read_command
    from ..checkpoints.inputs import input_names
    from ..checkpoints.outdir import check_out, save_atomic
    cmd = read_command(vars(args), CompareCommand)  # every option, before any work
    inputs = [args.a, args.b] + ([cmd.data] if cmd.data else [])
    if cmd.out:
        check_out(cmd.out, force=cmd.force, inputs=inputs)  # before any work
    res = compare_paths(args.a, args.b, cmd.data, null=cmd.null, seed=cmd.seed,
                        out_of_core=True if cmd.out_of_core else None, **engine_options(cmd))
    print(res.to_json() if cmd.as_json else res.summary())
    if cmd.out:
        record = res.to_json()

        def write(d):
            with open(os.path.join(d, "compare.json"), "w", encoding="utf-8") as f:
                f.write(record)
            plot_layers(res, os.path.join(d, "compare.png"),
                        f"{os.path.basename(os.path.normpath(str(args.b)))} in the basis of "
                        f"{os.path.basename(os.path.normpath(str(args.a)))}")
        out = save_atomic(write, cmd.out, force=cmd.force, inputs=inputs,
                          meta={"mode": "compare", "inputs": input_names([args.a, args.b]), "verdict": res.verdict},
                          record="symgraph_compare.json")
        if not cmd.as_json:
            print(f"wrote {out}/compare.json and compare.png")
    return 0


def add_parser(sub, debug_default):
    from ..app.commands import CompareCommand
    from ..app.options import add_flags
    c = sub.add_parser("compare", help="whether B is a copy of A (same), derived from it or unrelated, "
                       "up to every symmetry the graph admits")
    c.add_argument("a", help="model A (save_pretrained directory, demo name or hub id)")
    c.add_argument("b", help="model B, of A's architecture (other widths are compared through the "
                   "alignment's transport maps: at most derived)")
    add_flags(c, CompareCommand)  # every option, from its declaration (merge's, where it shares one)
    c.add_argument("--debug", action="store_true", default=debug_default)
    c.set_defaults(func=cmd_compare)
    return c

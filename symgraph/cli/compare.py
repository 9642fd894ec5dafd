"""``symgraph compare A B [--data F] [--out DIR] [--json]``: is B a copy of A, derived from
it, or unrelated, up to every symmetry the graph admits (:func:`symgraph.alignment.compare.compare`)?
A few lines of verdict and evidence; ``--json`` prints the per-tensor numbers instead;
``--out`` writes them (compare.json) and a plot of the per-layer similarity (compare.png)."""
from __future__ import annotations

import os

__all__ = ["add_parser", "cmd_compare", "plot_layers"]


def plot_layers(res, path: str, title: str = "") -> None:
    """The median correlation after alignment of each layer (bars), the null level and the
    level a layer needs to carry a "derived" verdict (lines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in res.layers if r["tensors"]]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(rows) + 2), 3.8))
    xs = range(len(rows))
    ax.bar(xs, [r["correlation"] for r in rows], color=["tab:red" if r["carries"] else "tab:gray" for r in rows])
    mu0 = res.null_mean
    ax.axhline(mu0, color="k", lw=0.8, ls=":", label=f"null (shuffled B) {mu0:.2f}")
    ax.axhline(mu0 + res.threshold * (1 - mu0), color="tab:blue", lw=0.8, ls="--",
               label=f"derived level (excess {res.threshold:g})")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["layer"] for r in rows], rotation=60, ha="right", fontsize=6)
    ax.set_ylim(min(0.0, min((r["correlation"] for r in rows), default=0.0)), 1.02)
    ax.set_ylabel("median correlation after alignment")
    ax.set_title(f"{title}: {res.verdict}" if title else res.verdict, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_compare(args) -> int:
    from ..alignment.compare import compare
    from ..checkpoints.outdir import check_out, save_atomic
    from ..checkpoints.specs import load_data, load_model
    from ..errors import InputError
    from ..merging.run import check_paths, input_names
    inputs = [args.a, args.b] + ([args.data] if args.data else [])
    if args.out:
        check_out(args.out, force=args.force, inputs=inputs)  # before any work
    if args.null < 0:
        raise InputError(f"--null {args.null}; expected a number of shuffled copies >= 0")
    check_paths([args.a, args.b])
    A, B = load_model(args.a), load_model(args.b)
    if type(A) is not type(B):
        raise InputError(f"{args.a!r} is a {type(A).__name__} but {args.b!r} is a {type(B).__name__}; "
                         "expected two models of one architecture")
    data = load_data(args.data, A) if args.data else None
    res = compare(A, B, data, null=args.null, seed=args.seed)
    print(res.to_json() if args.json else res.summary())
    if args.out:
        record = res.to_json()

        def write(d):
            with open(os.path.join(d, "compare.json"), "w", encoding="utf-8") as f:
                f.write(record)
            plot_layers(res, os.path.join(d, "compare.png"),
                        f"{os.path.basename(os.path.normpath(str(args.b)))} in the basis of "
                        f"{os.path.basename(os.path.normpath(str(args.a)))}")
        out = save_atomic(write, args.out, force=args.force, inputs=inputs,
                          meta={"mode": "compare", "inputs": input_names([args.a, args.b]), "verdict": res.verdict})
        if not args.json:
            print(f"wrote {out}/compare.json and compare.png")
    return 0


def add_parser(sub, debug_default):
    c = sub.add_parser("compare", help="whether B is a copy of A (same), derived from it or unrelated, "
                       "up to every symmetry the graph admits")
    c.add_argument("a", help="model A (save_pretrained directory, demo name or hub id)")
    c.add_argument("b", help="model B, of A's architecture and widths")
    c.add_argument("--data", metavar="FILE", help=".safetensors/.pt with 'input_ids' [N, S]: align by "
                   "activations (default: by weights)")
    c.add_argument("--null", type=int, default=4, metavar="N",
                   help="shuffled copies of B aligned for the null (default 4; 0: none, no p-value)")
    c.add_argument("--seed", type=int, default=0, help="seed of the shuffles")
    c.add_argument("--json", action="store_true", help="print the per-tensor numbers as JSON")
    c.add_argument("--out", metavar="DIR", help="write compare.json and compare.png into this new directory")
    c.add_argument("--force", action="store_true", help="replace an existing --out (a previous output)")
    c.add_argument("--debug", action="store_true", default=debug_default)
    c.set_defaults(func=cmd_compare)
    return c

"""``symgraph rotate MODEL --out DIR``: a checkpoint rotated for quantization, out of core
(see :mod:`symgraph.rotation.checkpoint` and :func:`symgraph.rotate`)."""
from __future__ import annotations

__all__ = ["add_parser"]


def cmd_rotate(args) -> int:
    from ..core.schema import SEED
    from ..rotation.checkpoint import rotate_checkpoint
    SEED.check(args.seed, "--seed")  # before any work
    rec = rotate_checkpoint(args.model, args.out, how=args.how, seed=args.seed, memory_budget=args.memory_budget,
                            classes=tuple(args.classes), untie=not args.keep_tied, force=args.force)
    r = rec["symgraph_rotate"]
    what = ", ".join(f"{role}: {len(ids)}" for role, ids in r["classes"].items())
    print(f"rotated {args.model} ({args.how}, seed {args.seed}; classes {what}"
          f"{'; head untied' if r['untied'] else ''}; {r['seconds']:.1f} s, at most {r['bytes_held'] / 1e6:.1f} MB "
          f"held) into {rec['out']}")
    return 0


def add_parser(sub, debug_default):
    r = sub.add_parser("rotate", help="rotate a checkpoint for quantization (function-preserving: "
                       "randomized Hadamard on the residual stream and the heads' value-output maps)")
    r.add_argument("model", help="save_pretrained directory")
    r.add_argument("--out", metavar="DIR", required=True, help="output directory (must not exist unless --force)")
    r.add_argument("--how", choices=("hadamard", "random"), default="hadamard",
                   help="randomized Hadamard (random orthogonal where no Hadamard matrix of the width is known) "
                   "or Haar-random rotations")
    r.add_argument("--seed", type=int, default=0, help="seed of the random signs / rotations")
    r.add_argument("--classes", nargs="+", choices=("stream", "vo", "qk"), default=["stream", "vo"],
                   help="the classes to rotate (default: the residual stream and each head's value-output map)")
    r.add_argument("--keep-tied", action="store_true",
                   help="keep a tied output head tied (then the residual stream cannot rotate)")
    r.add_argument("--memory-budget", metavar="SIZE", default=None,
                   help="bytes held at once (e.g. 2GB); large tensors are rotated in row slices to fit")
    r.add_argument("--force", action="store_true", help="replace an existing --out (a previous output)")
    r.add_argument("--debug", action="store_true", default=debug_default)
    r.set_defaults(func=cmd_rotate)

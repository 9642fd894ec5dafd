"""``symgraph align A B --out DIR`` and ``symgraph apply ALIGNMENT C --out DIR``: B (or any
checkpoint of B's architecture, such as a fine-tune of B) written in A's basis, for any tool to
merge (see :mod:`symgraph.app.carry`)."""
from __future__ import annotations

__all__ = ["add_parsers"]


def cmd_align(args) -> int:
    from ..app.carry import run_align
    from ..app.commands import AlignCommand, engine_options, read_command
    cmd = read_command(vars(args), AlignCommand)
    rec = run_align(args.a, args.b, cmd.out, align=cmd.align, data=cmd.data, force=cmd.force,
                    **engine_options(cmd, cmd.align))
    print(f"wrote {args.b} in the basis of {args.a} (aligned by {cmd.align}, {rec['seconds']:.1f} s) into "
          f"{rec['out']}, with the alignment in {rec['symgraph_align']['alignment']}")
    return 0


def cmd_apply(args) -> int:
    from ..app.carry import run_apply
    rec = run_apply(args.alignment, args.model, args.out, force=args.force)
    print(f"wrote {args.model} carried by {args.alignment} ({rec['symgraph_apply']['seconds']:.1f} s) "
          f"into {rec['out']}")
    return 0


def add_parsers(sub, debug_default):
    from ..app.commands import AlignCommand
    from ..app.options import add_flags
    a = sub.add_parser("align", help="write B in A's basis (and the alignment), for any tool to merge")
    a.add_argument("a", help="model A, the basis (save_pretrained directory)")
    a.add_argument("b", help="model B, of A's architecture and widths (save_pretrained directory)")
    add_flags(a, AlignCommand)  # every option, from its declaration (merge's, where it shares one)
    a.add_argument("--debug", action="store_true", default=debug_default)
    a.set_defaults(func=cmd_align)

    p = sub.add_parser("apply", help="carry another checkpoint of B's architecture (e.g. a fine-tune of B) "
                       "into A's basis with a saved alignment")
    p.add_argument("alignment", help="symgraph_alignment.safetensors (or the directory symgraph align wrote)")
    p.add_argument("model", help="a save_pretrained directory of B's architecture and shapes")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out (a previous output)")
    p.add_argument("--debug", action="store_true", default=debug_default)
    p.set_defaults(func=cmd_apply)

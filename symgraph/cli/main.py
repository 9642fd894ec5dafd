"""The ``symgraph`` command: ``analyze``, ``merge``, ``barrier``, ``align``, ``apply``, ``resize`` and
``demo``, thin over the library.

Every refusal is one paragraph on stderr (what was wrong, what was expected), exit code 2,
nothing written; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

from .._version import __version__
from ..app.config import MergeConfig
from ..app.options import add_flags
from ..core.progress import bar as progress_bar
from ..checkpoints.inputs import check_paths, input_names
from .align import add_parsers as add_align_parsers
from .barrier import add_parser as add_barrier_parser
from .compare import add_parser as add_compare_parser
from .merge import cmd_merge
from .rotate import add_parser as add_rotate_parser
from .data import add_parser as add_data_parser

__all__ = ['main', 'build_parser']

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_PIPE = 141  # the reader of stdout went away (``| head``): 128 + SIGPIPE, as a shell reports it



def _methods() -> tuple:
    from ..merging import merge_methods
    return merge_methods()


class _Refusal(Exception):
    """A refusal raised by the CLI itself (bad options)."""


# --- analyze -------------------------------------------------------------------------------


def cmd_analyze(args) -> int:
    from ..report.api import analyze
    from ..checkpoints.specs import load_model
    from ..checkpoints.outdir import check_new_file
    from ..errors import InputError
    for opt, p in (("--dot", args.dot), ("--png", args.png)):
        if p:
            check_new_file(p, opt, inputs=[args.model])
    if args.dot and args.png and os.path.realpath(args.dot) == os.path.realpath(args.png):
        raise _Refusal(f"--dot and --png are both {args.dot!r}; expected two different files")
    if args.dot and not args.dot.lower().endswith(".dot"):
        raise _Refusal(f"--dot {args.dot!r} must end in .dot")
    if args.png and not args.png.lower().endswith((".png", ".svg")):
        raise _Refusal(f"--png {args.png!r} must end in .png (or .svg)")
    with progress_bar(total=2, enabled=True, desc="analyze") as bar:
        bar.set_postfix_str("loading")
        model = load_model(args.model)
        bar.update()
        bar.set_postfix_str("tracing")
        report = analyze(model, fold_norms=not args.no_fold_norms, outputs=args.outputs)
        bar.update()
    if args.json:
        print(report.to_json())
    else:
        print(report.summary())
    if args.certify:  # random elements of every group applied, outputs compared (raises when off)
        dev = report.certify(model)
        print(f"certified: random elements of all {len(report.groups)} groups change the outputs by at most "
              f"{dev:.2e} (relative)", file=sys.stderr if args.json else sys.stdout)
    for opt, p in (("--dot", args.dot), ("--png", args.png)):
        if p:
            try:
                report.save_graph(p)
            except InputError as e:  # Graphviz that cannot draw: the option named
                raise InputError(f"{opt}: {e}") from None
            if not args.json:
                print(f"wrote {p}")
    return 0



# --- resize --------------------------------------------------------------------------------


def cmd_resize(args) -> int:
    from ..report.api import analyze
    from ..checkpoints.specs import load_model
    from ..checkpoints.outdir import check_out, save_atomic
    from ..width.resize import resize, same_role
    from ..core.schema import SEED
    widths = {}
    for spec in args.width:
        ids, _, n = spec.partition("=")
        try:
            ids, n = [int(i) for i in ids.split(",")], int(n)
        except ValueError:
            raise _Refusal(f"--width {spec!r}: expected IDS=N (group ids from symgraph analyze, "
                           "comma-separated, and the new width), e.g. --width 5,10=96") from None
        widths.update({i: n for i in ids})
    SEED.check(args.seed, "--seed")
    out = check_out(args.out, force=args.force, inputs=[args.model])
    check_paths([args.model])
    model = load_model(args.model)
    report = analyze(model)
    if args.every_layer:
        widths = same_role(report, widths)
    t0 = time.time()
    res = resize(model, widths, split=args.split, seed=args.seed, report=report)
    meta = {"symgraph_version": __version__, "inputs": input_names([args.model]),
            "mode": "resize", "widths": res.widths, "config": res.config, "error": res.error,
            "split": args.split, "seed": args.seed, "seconds": time.time() - t0,
            "dtype": str(next(res.model.parameters()).dtype).removeprefix("torch.")}
    src = os.path.expanduser(args.model)
    save_atomic(res.model, out, force=args.force, inputs=[args.model], meta=meta,
                tokenizer_from=src if os.path.isdir(src) else None, record="symgraph_resize.json")
    sizes = ", ".join(f"{g}: {a} -> {b}" for g, (a, b) in sorted(res.widths.items()))
    cfg = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in res.config.items())
    print(f"resized classes {sizes}{f' ({cfg})' if cfg else ''}; relative output deviation "
          f"{res.error:.3g}; wrote {out}")
    return 0


# --- demo ----------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    from .demo import SECONDS, run_demo
    if args.seconds is not None:
        SECONDS.check(args.seconds, "--seconds")  # before any work
    run_demo(out=args.out, seconds=args.seconds, force_retrain=args.retrain, force=args.force)
    return 0


# --- main ----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``symgraph merge: argument --refine: invalid int value``),
    exit 2; ``-h`` still prints the full usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} -h)\n")


def _add_analyze_parser(sub) -> None:
    a = sub.add_parser("analyze", help="report the weight-space symmetries of a model")
    a.add_argument("model", help="save_pretrained directory, demo name (tiny-bert, tiny-gpt2, "
                   "tiny-llama, tiny-vit) or hub id")
    a.add_argument("--json", action="store_true", help="print only the JSON report")
    a.add_argument("--no-fold-norms", action="store_true",
                   help="do not fold norm gains (residual streams stay permutations)")
    a.add_argument("--outputs", nargs="+", metavar="NAME", default=None,
                   help="the outputs a symmetry must keep (e.g. logits), or all; "
                        "default: a head model's outputs other than hidden states")
    a.add_argument("--certify", action="store_true",
                   help="apply random elements of every group and print the outputs' deviation")
    a.add_argument("--dot", metavar="FILE", help="write the group graph as Graphviz .dot")
    a.add_argument("--png", metavar="FILE", help="write the group graph as .png (or .svg)")
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    a.set_defaults(func=cmd_analyze)


def build_parser():
    p = _Parser(prog="symgraph", description="Graph-based symmetry compiler: analyse "
                "and merge neural networks.")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line refusals")
    p.add_argument("--version", action="version", version=f"symgraph {__version__}")
    p.add_argument("--quiet", action="store_true", help="no progress bars, notes or warnings on stderr (bars "
                   "show only on a terminal, or anywhere with SYMGRAPH_PROGRESS=1); refusals still show")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_analyze_parser(sub)

    m = sub.add_parser("merge", help="align and merge N models of one architecture")
    m.add_argument("models", nargs="*", help="two or more model directories / names")
    m.add_argument("--config", metavar="YAML", help="merge options from a YAML file (the flags below win)")
    add_flags(m, MergeConfig, choices_for={"method": _methods()})  # every option, from its one declaration
    m.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    m.set_defaults(func=cmd_merge)

    add_barrier_parser(sub, argparse.SUPPRESS)
    add_align_parsers(sub, argparse.SUPPRESS)
    add_compare_parser(sub, argparse.SUPPRESS)
    add_rotate_parser(sub, argparse.SUPPRESS)
    add_data_parser(sub, argparse.SUPPRESS)

    r = sub.add_parser("resize", help="widen (function-preserving) or shrink (compress) "
                       "permutation classes of a model")
    r.add_argument("model", help="save_pretrained directory, demo name or hub id")
    r.add_argument("--width", action="append", required=True, metavar="IDS=N",
                   help="new width N for the classes IDS (ids from symgraph analyze, e.g. 5,10=96)")
    r.add_argument("--every-layer", action="store_true",
                   help="also resize every class with the same role in the other layers")
    r.add_argument("--split", choices=("even", "random"), default="even",
                   help="how a widened unit's outgoing weights are shared by its copies")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", metavar="DIR", required=True, help="output directory (must not exist "
                   "unless --force)")
    r.add_argument("--force", action="store_true", help="replace an existing --out")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    r.set_defaults(func=cmd_resize)

    d = sub.add_parser("demo", help="train two tiny byte-level GPT-2s and compare merges")
    d.add_argument("--out", metavar="DIR", default="symgraph-demo")
    d.add_argument("--seconds", type=float, default=None, help="training budget in seconds (total)")
    d.add_argument("--retrain", action="store_true", help="ignore the cached models")
    d.add_argument("--force", action="store_true", help="replace an existing --out (a previous demo output)")
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    d.set_defaults(func=cmd_demo)
    for sp in sub.choices.values():  # --quiet after the subcommand too, as --debug
        sp.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _refuse(msg: str) -> int:
    msg = " ".join(str(msg).split())
    print("symgraph: " + textwrap.fill(msg, width=100, subsequent_indent="  ",
                                       break_long_words=False, break_on_hyphens=False),
          file=sys.stderr)
    return EXIT_REFUSED


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..core.progress import configure, silenced
    configure(active=True, quiet=getattr(args, "quiet", False))  # the engine's bars, on a terminal
    try:
        with silenced():  # --quiet: our notes and warnings too, on every command
            return _run(args)
    finally:
        configure(active=False)


def _run(args) -> int:
    debug = getattr(args, "debug", False)
    if debug:
        return args.func(args)
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from ..errors import SymgraphError, TraceError
    from ..checkpoints.outdir import Terminated, terminate_on_sigterm
    terminate_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe found here, not in the interpreter's exit
        return code
    except BrokenPipeError:  # not bad input: end quietly, stdout sent nowhere for the exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except TraceError as e:
        return _refuse(f"{e} Hint: symgraph traces the model with torch.export; models with "
                       "data-dependent control flow or unsupported ops cannot be traced. Run with "
                       "--debug for the full traceback.")
    except (SymgraphError, _Refusal, FileNotFoundError, ValueError, OSError) as e:
        return _refuse(str(e) if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        _refuse(f"interrupted (Ctrl-C); {_what_was_written()}")
        return EXIT_INTERRUPTED
    except Terminated:
        _refuse(f"terminated (SIGTERM); {_what_was_written()}")
        return EXIT_TERMINATED


def _what_was_written() -> str:
    from ..checkpoints.outdir import COMMITTED
    return f"{COMMITTED[-1]} was already complete" if COMMITTED else "nothing was written"


if __name__ == "__main__":
    sys.exit(main())

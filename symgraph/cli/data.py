"""``symgraph data TEXT... --tokenizer DIR --out FILE``: a data file from text, with the model's
own tokenizer (see :mod:`symgraph.checkpoints.textdata`)."""
from __future__ import annotations

__all__ = ["add_parser"]


def cmd_data(args) -> int:
    from ..checkpoints.textdata import read_texts, write_data_file
    texts = read_texts(args.text)
    info = write_data_file(texts, args.tokenizer, args.out, max_length=args.max_length, mode=args.mode,
                           inputs=args.text)
    print(f"wrote {info['rows']} rows of {info['length']} tokens ({info['tokens']} tokens, {info['padding']} "
          f"padding positions, masked) to {info['out']}")
    return 0


def add_parser(sub, debug_default):
    d = sub.add_parser("data", help="build a data file (input_ids and attention_mask) from text with a tokenizer")
    d.add_argument("text", nargs="+", help="UTF-8 text files")
    d.add_argument("--tokenizer", metavar="DIR", required=True,
                   help="a directory holding the model's tokenizer (its save_pretrained directory)")
    d.add_argument("--out", metavar="FILE", required=True, help="the new data file (.safetensors)")
    d.add_argument("--max-length", type=int, default=128, metavar="N",
                   help="tokens per row at most (lines) or exactly (blocks); default 128")
    d.add_argument("--mode", choices=("lines", "blocks"), default="lines",
                   help="lines: one row per non-empty line, padded and masked; blocks: the text as one stream "
                   "cut into rows of --max-length tokens")
    d.add_argument("--debug", action="store_true", default=debug_default)
    d.set_defaults(func=cmd_data)

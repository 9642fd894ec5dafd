"""Rule coverage: the ops of traced models that have no rule.

``python -m symgraph.cli.coverage MODEL [MODEL ...]`` (checkpoint directories, demo names such
as ``tiny-llama``, or hub ids in the local cache) traces each model as :func:`symgraph.analyze`
does (ops core ATen can decompose are decomposed first) and prints every op that reaches the
analysis without a rule, with how often it occurs and in which models. Such an op freezes the
axes it touches; a rule for it is the way to free them."""
from __future__ import annotations

import argparse
import collections
import sys

__all__ = ["unruled_ops", "main"]


def unruled_ops(model, inputs=None) -> collections.Counter:
    """``{op name: count}`` of the call sites in ``model``'s traced graph that have no rule, on
    values that depend on a parameter or an input (an op on a constant path, such as a mask's
    construction, freezes nothing and is not counted)."""
    from ..passes.driver import CONST_OPS, IGNORED
    from ..passes.nodes import packet
    from ..passes.registry import has_rule
    from ..passes.trace import trace, varying_nodes
    ep, _, _ = trace(model, inputs)
    varying = varying_nodes(ep)
    out: collections.Counter = collections.Counter()
    for n in ep.graph.nodes:
        if n not in varying:
            continue
        if n.op != "call_function" or not hasattr(n.target, "overloadpacket"):
            continue
        if packet(n) in IGNORED or packet(n) in CONST_OPS or has_rule(n.target):
            continue
        out[str(n.target)] += 1
    return out


def main(argv=None) -> int:
    from ..checkpoints.specs import load_model
    from ..errors import SymgraphError
    ap = argparse.ArgumentParser(prog="python -m symgraph.cli.coverage", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="checkpoint directories, demo names or hub ids")
    a = ap.parse_args(argv)
    seen: collections.Counter = collections.Counter()
    where: collections.defaultdict = collections.defaultdict(set)
    for spec in a.models:
        try:
            ops = unruled_ops(load_model(spec))
        except (SymgraphError, OSError) as e:
            print(f"symgraph coverage: {spec}: {e}", file=sys.stderr)
            return 2
        seen.update(ops)
        for op in ops:
            where[op].add(spec)
    if not seen:
        print(f"every op of {len(a.models)} model(s) has a rule")
        return 0
    print(f"{'op':48s} {'sites':>5s}  models")
    for op, k in seen.most_common():
        print(f"{op:48s} {k:5d}  {', '.join(sorted(where[op]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What blocks a missing class, read from the graph and the analysis (never from a family's
name): the op or pattern that narrowed the classes on the weights it should act on, or that
kept a head's class from varying per head."""
from __future__ import annotations

import collections
import re

from symgraph.core.groups import meet

from .attention import attention_units
from .graph import LINEAR, is_constant, linear_weight, pname, slot_source

__all__ = ["explain"]

_MAX = 3  # at most this many ops named per missing entry


def explain(ep, report, missing) -> None:
    """Add ``"why"`` (the ops or patterns that block it: ``"op: reason; ..."``, node names without
    their numbering, so that every layer reads alike) and ``"where"`` (the weight axis read) to
    each entry of ``missing`` (:func:`~.structure.expectations`). A slot read under another name
    of a tied tensor is asked of the report under the name it reports (``report.aliases``)."""
    units = {u["module"]: u for u in attention_units(ep)}
    named = {o: k for k, others in report.aliases.items() for o in others}
    for m in missing:
        if "why" in m:
            continue
        why, where = None, None
        if m["kind"] == "attention-heads" and m["module"] in units:
            why, where = _heads(ep, report, units[m["module"]], named)
        elif m["kind"] == "rope":
            why = _rope(report, [u for u in units.values() if u["rotated"] and not u["qk_norm"]])
        elif m["kind"] == "mlp-perm" and m.get("slots"):
            why = _slots(report, [(named.get(p, p), d) for p, d in m["slots"]])
        m["why"] = why or "no op recorded (a class is missing that no constraint ruled out)"
        if where:
            m["where"] = where


def projection(ep, node):
    """``(param, dim)``: the output slot of the first linear-like op of a parameter on the way
    back from ``node`` (the query's projection), else None."""
    queue, seen = collections.deque([node]), set()
    while queue and len(seen) < 256:
        n = queue.popleft()
        if n in seen or not hasattr(n, "op") or n.op != "call_function":
            continue
        seen.add(n)
        if pname(n) in LINEAR or pname(n) == "einsum":
            w = linear_weight(ep, n)
            if w is not None:
                return w[1]
            if pname(n) in ("convolution", "conv1d", "conv2d", "conv3d") and len(n.args) > 1:
                out = slot_source(ep, n.args[1], 0)  # grouped: its output channels all the same
                if out is not None:
                    return out
        queue.extend(a for a in n.all_input_nodes if not is_constant(ep, a))
    return None


def _heads(ep, report, unit, named):
    slot = projection(ep, unit["query"])
    if slot is None:
        return "the query is no projection of a parameter (no head class can hold it)", None
    slot = (named.get(slot[0], slot[0]), slot[1])
    items = []
    for leaf in report.axis_reasons(*slot):
        items += leaf["nofiber"]  # what kept the head dimensions from varying per head
        if leaf["kind"] == "identity" and leaf["size"] > 1:
            items += _narrowed(leaf, lambda k: k == "identity")
    return _join(items, "no per-head class: "), f"{slot[0]} dim {slot[1]}"


def _rope(report, units) -> str | None:
    if not units:
        return "no rotation of a projected query was found (the rotated values reach attention another way)"
    items = []
    for u in units:  # the classes of the rotated query's last axis
        for leaf in report.axis_reasons(u["query"].name, -1):
            items += _narrowed(leaf, lambda k: meet(k, "rope") != "rope")
    return _join(items, "the rotated coordinates are narrowed past rotations: ")


def _slots(report, slots) -> str | None:
    items = []
    for p, d in slots:
        try:
            leaves = report.axis_reasons(p, d)
        except (KeyError, IndexError):
            continue
        for leaf in leaves:
            items += leaf["nofiber"]
            if leaf["kind"] == "identity":
                items += _narrowed(leaf, lambda k: k == "identity")
    return _join(items, "fixed: ")


def _narrowed(leaf, bad) -> list:
    """Why ``leaf`` has a kind ``bad`` accepts: for a fixed class whose reasons name two kinds with
    no common subgroup (rotations met by a permutation), both; else the last such reason."""
    rs = [_kind_cause(k, w) for k, w in leaf["reasons"]]
    if leaf["kind"] == "identity":
        first: dict = {}
        for k, w in rs:
            first.setdefault(k, w)
        met = [f"{w} [{k}]" for k, w in first.items() if k != "identity"]
        if len(met) >= 2 and "identity" not in first:
            return [" meets ".join(met[-2:])]
    rs = [(k, w) for k, w in rs if bad(k)]
    return [rs[-1][1]] if rs else []


def _kind_cause(kind, reason):
    """``(kind, reason)`` with ``part of a class narrowed to K (X)`` read as ``(K, X)``."""
    while m := re.match(r"part of a class narrowed to (\w+) \((.*)\)$", reason):
        kind, reason = m.groups()
    return kind, reason


def _join(items, lead) -> str | None:
    out: list = []
    for it in items:
        it = _unnumbered(_root_cause(it))
        if it not in out:
            out.append(it)
    out = [it for it in out if not any(it != o and it in o for o in out)]  # said in another
    if not out:
        return None
    more = f" (+{len(out) - _MAX} more)" if len(out) > _MAX else ""
    return lead + "; ".join(out[:_MAX]) + more


def _root_cause(reason: str) -> str:
    """``part of a class narrowed to identity (X)`` -> ``X``, innermost."""
    while reason.startswith("part of a class narrowed to ") and "(" in reason and reason.endswith(")"):
        reason = reason[reason.index("(") + 1:-1]
    return reason


def _unnumbered(reason: str) -> str:
    """``conv1d_5 (aten.conv1d): ...`` -> ``conv1d (aten.conv1d): ...``: the node's op, not
    which of its copies."""
    return re.sub(r"\b([A-Za-z]\w*?)_\d+(?=[ :])", r"\1", reason)


def _leaves(report, slot):
    """``report.axis_reasons(*slot)``, None for a slot in no class."""
    try:
        return report.axis_reasons(*slot)
    except (KeyError, IndexError, ValueError):
        return None


def fixed_unsaved(report, slot) -> bool:
    """Whether a tensor no checkpoint of the model stores fixes the slot's class."""
    unsaved = set(getattr(report, "unsaved", {}).values())
    return any(kind == "identity" and why in unsaved for leaf in _leaves(report, slot) or ()
               for kind, why in leaf.get("reasons", ()))


def frozen_why(report, slot) -> str:
    """The reasons the analysis recorded for the slot's class."""
    leaves = _leaves(report, slot)
    if leaves is None:
        return "not in any class"
    whys = []
    for leaf in leaves:
        for _, w in leaf.get("reasons", ())[-1:]:
            if _unnumbered(w) not in whys:
                whys.append(_unnumbered(w))
    return "fixed: " + "; ".join(whys[:2]) if whys else "no op recorded"

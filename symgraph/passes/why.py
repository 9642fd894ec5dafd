"""Why an axis's classes are what they are: per leaf class, its kind, the reasons that narrowed
it, the classes it is fibred over, and the ops that kept it from being fibred over another
leaf of the axis. Read by :meth:`~symgraph.report.symmetry.AxisQueries.axis_reasons`."""
from __future__ import annotations

__all__ = ["axis_reasons"]


def axis_reasons(an, axis) -> list:
    """``[{"size", "kind", "reasons": [(kind, reason), ...], "fibre": [sizes], "nofiber":
    [op, ...]}]`` for the leaf classes of ``axis``, outer to inner. ``nofiber`` lists the ops
    that forbade the leaf to vary along a leaf outside it on this axis (a grouped convolution's
    one map for every group, a mean over heads)."""
    uf = an.uf
    leaves = an.leaves(axis)
    out = []
    for i, leaf in enumerate(leaves):
        r = uf.find(leaf)[0]
        outer = {uf.find(x)[0] for x in leaves[:i]} - {r}  # the classes a fibre would be over
        nofib = []
        for (a, over), why in getattr(an, "nofiber_why", {}).items():
            if r in {uf.find(x)[0] for x in an.leaves(a)} and \
                    {uf.find(x)[0] for x in an.leaves(over)} & outer and why not in nofib:
                nofib.append(why)
        out.append({"size": uf.size[r], "kind": an.kind(r), "reasons": list(uf.reasons.get(r, [])),
                    "fibre": [uf.size[f] for f in an.fibre.get(r, ())], "nofiber": nofib})
    return out

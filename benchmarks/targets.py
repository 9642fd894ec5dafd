"""The suite's merge-quality targets, read from its records.

Per architecture, from the barriers averaged over pairs (an interpolation method's barrier, a
single merged model's midpoint gap): vanilla averaging's; the best symgraph method without
learned matching and ``symgraph_refine``, each also as a fraction of vanilla's; the best seed
method; the best of aligned Fisher and RegMean. A target is met when:

* ``without refine``: best symgraph method other than ``symgraph_refine`` ≤ :data:`WITHOUT_REFINE` × vanilla;
* ``with refine``: ``symgraph_refine`` ≤ :data:`WITH_REFINE` × vanilla;
* ``< seeds`` / ``< aligned Fisher, RegMean``: the best symgraph method (either) strictly below
  every seed method / both aligned merges.
"""
from __future__ import annotations

from .methods import SEED_METHODS, SYMGRAPH_METHODS
from .provenance import cell, table
from .records import renamed

WITHOUT_REFINE, WITH_REFINE = 0.35, 0.05
ALIGNED_MERGES = ("fisher_aligned", "regmean_aligned")
REFINE = "symgraph_refine"


def _means(records, arch) -> dict:
    got: dict = {}
    for r in renamed(records):
        if r.get("arch") == arch and r.get("kind") in ("interpolation", "merged"):
            got.setdefault(r["method"], []).append(r["barrier"])
    return {m: sum(v) / len(v) for m, v in got.items()}


def _best(means, names):
    have = [(means[m], m) for m in names if m in means]
    return min(have)[::-1] if have else (None, None)


def _below(x, y):
    return None if x is None or y is None else x < y


def targets(records, archs) -> list[dict]:
    """One dict per architecture with vanilla averaging's barrier: ``vanilla``, ``without``
    (``(method, barrier)``), ``refine`` (barrier or None), ``seed`` and ``aligned`` (``(method,
    barrier)``), ``ratio_without`` / ``ratio_refine`` (÷ vanilla) and ``met`` (target name →
    bool, or None where a needed method was not run)."""
    out = []
    for arch in archs:
        means = _means(records, arch)
        if "vanilla" not in means:
            continue
        van = means["vanilla"]
        without = _best(means, [m for m in SYMGRAPH_METHODS if m != REFINE])
        refine = means.get(REFINE)
        best = _best(means, SYMGRAPH_METHODS)[1]
        seed, aligned = _best(means, SEED_METHODS), _best(means, ALIGNED_MERGES)
        rw, rr = (None if x is None or van <= 0 else x / van for x in (without[1], refine))
        out.append({"arch": arch, "vanilla": van, "without": without, "refine": refine, "seed": seed,
                    "aligned": aligned, "ratio_without": rw, "ratio_refine": rr,
                    "met": {"without refine": None if rw is None else rw <= WITHOUT_REFINE,
                            "with refine": None if rr is None else rr <= WITH_REFINE,
                            "< seeds": _below(best, seed[1]), "< aligned Fisher, RegMean": _below(best, aligned[1])}})
    return out


def _named(pair):
    name, x = pair
    return "—" if x is None else f"{x:.3f} `{name}`"


def section(records, archs) -> list[str]:
    """The report's "Targets" section (markdown lines), empty without vanilla records."""
    got = targets(records, archs)
    if not got:
        return []
    names = list(got[0]["met"])
    rows = [[r["arch"], f"{r['vanilla']:.3f}", f"{_named(r['without'])} ({cell(r['ratio_without'], '.2f')})",
             f"{cell(r['refine'])} ({cell(r['ratio_refine'], '.2f')})", _named(r["seed"]), _named(r["aligned"]),
             *("—" if r["met"][k] is None else "yes" if r["met"][k] else "no" for k in names)] for r in got]
    return ["", "## Targets", "",
            f"Barrier (mean over pairs) of the best symgraph method without learned matching and of "
            f"`{REFINE}`, ÷ vanilla's (targets ≤ {WITHOUT_REFINE} and ≤ {WITH_REFINE}); the best symgraph "
            "method of either kind against the best seed method and the best aligned Fisher / "
            "RegMean merge (targets: strictly lower). A merged model's entry is its midpoint gap.", "",
            *table(["arch", "vanilla", "best without refine (÷ vanilla)", "refine (÷ vanilla)", "best seed",
                    "best aligned Fisher / RegMean", *names], rows)]

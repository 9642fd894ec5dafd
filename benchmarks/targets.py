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
from .provenance import cell
from .records import renamed

__all__ = ["WITHOUT_REFINE", "WITH_REFINE", "SEEDS", "ALIGNED_MERGES", "targets", "section"]

WITHOUT_REFINE, WITH_REFINE = 0.35, 0.05
SEEDS = SEED_METHODS
ALIGNED_MERGES = ("fisher_aligned", "regmean_aligned")
REFINE = "symgraph_refine"


def _means(records, arch) -> dict:
    got: dict = {}
    for r in renamed(records):  # records under the seed methods' former names too
        if r.get("arch") == arch and r.get("kind") in ("interpolation", "merged"):
            got.setdefault(r["method"], []).append(r["barrier"])
    return {m: sum(v) / len(v) for m, v in got.items()}


def _best(means, names):
    have = [(means[m], m) for m in names if m in means]
    return min(have)[::-1] if have else (None, None)


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
        seed, aligned = _best(means, SEEDS), _best(means, ALIGNED_MERGES)
        ratio = lambda x: None if x is None or van <= 0 else x / van  # noqa: E731
        rw, rr = ratio(without[1]), ratio(refine)
        out.append({
            "arch": arch, "vanilla": van, "without": without, "refine": refine, "seed": seed,
            "aligned": aligned, "ratio_without": rw, "ratio_refine": rr,
            "met": {"without refine": None if rw is None else rw <= WITHOUT_REFINE,
                    "with refine": None if rr is None else rr <= WITH_REFINE,
                    "< seeds": None if best is None or seed[1] is None else best < seed[1],
                    "< aligned Fisher, RegMean": None if best is None or aligned[1] is None
                    else best < aligned[1]}})
    return out


def _named(pair):
    name, x = pair
    return "—" if x is None else f"{x:.3f} `{name}`"


def section(records, archs) -> list[str]:
    """The report's "Targets" section (markdown lines), empty without vanilla records."""
    rows = targets(records, archs)
    if not rows:
        return []
    names = list(rows[0]["met"])
    L = ["", "## Targets", "",
         f"Barrier (mean over pairs) of the best symgraph method without learned matching and of "
         f"`{REFINE}`, ÷ vanilla's (targets ≤ {WITHOUT_REFINE} and ≤ {WITH_REFINE}); the best symgraph "
         "method of either kind against the best seed method and the best aligned Fisher / "
         "RegMean merge (targets: strictly lower). A merged model's entry is its midpoint gap.", "",
         "| arch | vanilla | best without refine (÷ vanilla) | refine (÷ vanilla) | best seed | "
         "best aligned Fisher / RegMean | " + " | ".join(names) + " |",
         "|" + "---|" * (6 + len(names))]
    for r in rows:
        met = ["—" if r["met"][k] is None else ("yes" if r["met"][k] else "no") for k in names]
        L.append(f"| {r['arch']} | {r['vanilla']:.3f} | {_named(r['without'])} "
                 f"({cell(r['ratio_without'], '.2f')}) | {cell(r['refine'])} ({cell(r['ratio_refine'], '.2f')}) | "
                 f"{_named(r['seed'])} | {_named(r['aligned'])} | " + " | ".join(met) + " |")
    return L

"""``python -m benchmarks NAME [ARGS]``: the one runner of every benchmark.

``NAME``: a module ``benchmarks/bench_NAME.py`` or one of :data:`PACKAGES`; ``ARGS`` go to its
``main``. No name (or the suite's flags first: ``python -m benchmarks --quick``) runs the suite;
``--list`` names them all. Each benchmark also runs on its own as ``python -m benchmarks.bench_NAME``.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Benchmarks that are not a ``bench_*.py`` module: their name and the module whose ``main`` runs.
PACKAGES = {"suite": "benchmarks.suite", "anchor": "benchmarks.anchor.table",
            "coverage": "benchmarks.coverage.summary", "record": "benchmarks.provenance",
            "seeds": "benchmarks.seeds.run"}


def benchmarks() -> dict[str, str]:
    """``{name: module}`` of every benchmark: each ``bench_NAME.py`` and :data:`PACKAGES`."""
    found = {p.stem.removeprefix("bench_"): f"benchmarks.{p.stem}" for p in sorted(HERE.glob("bench_*.py"))}
    return found | PACKAGES


def main(argv=None) -> int:
    """Runs the named benchmark's ``main(ARGS)``; its integer result is the exit status (any
    other result: 0). An unknown name: exit 2 and one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    known = benchmarks()
    if argv[:1] in (["--list"], ["-l"]):
        print("\n".join(f"{name:20} python -m {mod}" for name, mod in sorted(known.items())))
        return 0
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0], argv[1:]
        if name not in known:
            print(f"python -m benchmarks: no benchmark named {name!r}; expected one of "
                  f"{', '.join(sorted(known))} (or the suite's flags)", file=sys.stderr)
            return 2
    else:
        name, rest = "suite", argv
    status = importlib.import_module(known[name]).main(rest)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    from benchmarks.harness import script
    script(main)

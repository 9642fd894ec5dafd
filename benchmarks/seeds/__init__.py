"""The seed papers' own released code beside our reimplementations of their methods
(``python -m benchmarks seeds``, :mod:`benchmarks.seeds.run`): the authors' code runs in a venv of
its own, imported, never edited, by a thin driver each (``drive_*.py``), which exchanges
safetensors files with the runner (:mod:`benchmarks.seeds.exchange`)."""

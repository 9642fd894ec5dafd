"""The seed papers' own released code beside our reimplementations of their methods.

``python -m benchmarks seeds`` (:mod:`benchmarks.seeds.run`) loads the suite's ViT and BERT
pairs, runs our reimplementations (:mod:`benchmarks.methods`) and the authors' code, each in a
virtual environment of its own (:data:`benchmarks.seeds.run.SEEDS`: pinned commits, pinned
packages), and evaluates every merged model the same way. The two sides exchange safetensors
files in a temporary directory (:mod:`benchmarks.seeds.exchange`); the authors' modules are
imported, never edited, by a thin driver each (``drive_imfeld.py``, ``drive_verma.py``,
``drive_zhang.py``, run by their venv's Python; ``driver_common.py`` holds what they share).
"""

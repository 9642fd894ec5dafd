"""Anchor reproduction: the parent-training protocol of Theus et al., "Generalized Linear Mode
Connectivity for Transformers" (NeurIPS 2025), Tiny Shakespeare experiment, and their own
released code run on the same parents.

:mod:`benchmarks.anchor.data` loads, splits and tokenizes the corpus and evaluates a model;
:mod:`benchmarks.anchor.train` trains one parent (``python -m benchmarks.anchor.train``); both are
self-contained (torch, transformers, numpy, stdlib; nothing from ``symgraph``).
:mod:`benchmarks.anchor.table` (``python -m benchmarks.anchor``) writes the table with symgraph's
rows and, given ``--peer-work DIR``, the rows of Theus et al.'s own weight matching
(:mod:`benchmarks.anchor.peer`: their source fetched by the user, never copied here, run in a venv
of its own through the glue :mod:`benchmarks.anchor.peer_run`).

Side by side, on the same parents, at one commit::

    python -m benchmarks.anchor.peer fetch --work WORK      # their repo at 6b207cc (--mirror PATH: a local clone)
    python -m benchmarks.anchor.peer venv --work WORK       # WORK/peer-venv: transformers==4.50.1, torch 2.13 CPU, ...
    python -m benchmarks.anchor --corpus CORPUS --tokenizer TOKENIZER_DIR --peer-work WORK [--tiny]

(the venv is also created on demand by the last command). ``--tiny`` trains tiny float32 parents
for a couple of minutes and writes to ``<cache>/tiny/results``: a smoke run of the whole command.

Not done yet: the full-size parents retrained in float32 as theirs (the committed table's parents
trained under bf16 autocast, and the committed results were not regenerated with the peer rows);
their learned matching (``train_merger.py``'s HF Trainer loop) with their budget; the seed papers'
released code (Verma & Elbayad, Imfeld et al., Zhang et al.).
"""

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

(the venv is also created on demand by the last command; ``--peer-python``/``--peer-pythonpath``
run their code without one). ``--tiny`` trains tiny float32 parents for a couple of minutes and
writes to ``<cache>/tiny/results``: a smoke run of the whole command. ``--device cuda`` trains
the parents (float32, TF32 off) and computes every row on the GPU; ``benchmarks/anchor/device.sh``
runs the whole table, both parents trained concurrently, in one call on a lent GPU machine.
:mod:`benchmarks.anchor.report` writes ``results.json`` (commit, code digest, device, each row's
options and wall time), ``report.md`` and ``curves.png`` after every row.

``--size small`` runs the same table, their columns included, on parents of the recipe that a
CPU trains in minutes (:data:`benchmarks.anchor.train.SIZES`; cache ``<cache>/small``, results
``benchmarks/results/anchor_small``); the paper size needs a GPU (``device.sh``). The learned
rows run at their budget (:data:`benchmarks.anchor.table.LEARN`): theirs through their
``train_merger.py`` loop (:mod:`benchmarks.anchor.peer_run`), ours for as many steps of the same
batches. The seed papers' released code runs beside our reimplementations in
:mod:`benchmarks.seeds`.
"""

"""Anchor reproduction: the Tiny Shakespeare experiment of Theus et al., "Generalized Linear Mode
Connectivity for Transformers" (NeurIPS 2025), with their own released code run on the same parents.
:mod:`.data` and :mod:`.train` (the parents) use nothing from ``symgraph``; :mod:`.table` (``python -m
benchmarks.anchor``) writes the table (:mod:`.report`) and, through :mod:`.peer` and its glue
:mod:`.peer_run`, their code's rows. Commands: docs/benchmarks.md; on a lent GPU: ``device.sh``.
"""

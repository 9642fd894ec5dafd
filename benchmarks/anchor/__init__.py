"""Anchor reproduction: the parent-training protocol of Theus et al., "Generalized Linear Mode
Connectivity for Transformers" (NeurIPS 2025), Tiny Shakespeare experiment.

Self-contained (torch, transformers, numpy, stdlib only; nothing from ``symgraph``):
:mod:`benchmarks.anchor.data` loads, splits and tokenizes the corpus and evaluates a model;
:mod:`benchmarks.anchor.train` trains one parent (``python -m benchmarks.anchor.train``).
"""

"""Tiny models built from configs (``models``) for tests, benchmarks, the demo and examples."""

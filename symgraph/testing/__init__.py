"""Tiny models built from configs (``models``; diffusers' models: ``diffusion``) for tests,
benchmarks, the demo and examples."""

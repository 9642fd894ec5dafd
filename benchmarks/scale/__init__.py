"""The scale benchmark's parts (its entry point and description: :mod:`benchmarks.bench_scale`),
shared by the benchmarks that write LLaMA-shaped bf16 pairs."""

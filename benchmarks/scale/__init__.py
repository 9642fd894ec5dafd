"""The scale benchmark's parts, one job a module; the entry point (and the docstring that
describes the benchmark) is :mod:`benchmarks.bench_scale`.

* :mod:`.common`: shapes, stages, constants, the log, the child environment and the measuring
  wrapper (one child's wall/CPU time and peak RSS).
* :mod:`.checkpoints`: the meta-device checkpoint writer (shards in parallel processes on
  request), checkpoint file helpers, dropping/warming the page cache, the read-throughput loop.
* :mod:`.mergekit`: mergekit in its own venv, its config.
* :mod:`.checks`: output checks (headers, ``from_pretrained``, streamed comparison).
* :mod:`.stages`: one shape's stages, run and measured.
* :mod:`.report`: the Markdown table.
* :mod:`.probe`: what a run in this process reads, solves on and holds (the device benchmark
  from disk, :mod:`benchmarks.bench_device_disk`).
"""

"""Tests of the benchmarks' own tooling: the runner, the results writer, the records."""

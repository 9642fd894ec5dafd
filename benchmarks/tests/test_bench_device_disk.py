"""The out-of-core device benchmark (benchmarks/bench_device_disk.py) at the tiny shape: the
code path the GPU runs (``run_merge`` out of core with ``device=``), on the CPU and on the
``fakegpu`` test device, with real values checked."""
from __future__ import annotations

import filecmp
import json

import pytest


def _run(tmp_path, device, stages="1", extra=()):
    from benchmarks import bench_device_disk as B
    out = tmp_path / "res" / "disk.json"
    args = ["--shape", "tiny", "--layers", "1", "--stages", stages, "--device", device, "--work",
            str(tmp_path / "work"), "--out", str(out), "--workers", "1", "--commit", "test", "--no-warmup",
            "--heartbeat", "0", *extra]
    assert B.main(args) == 0
    res = json.loads(out.read_text())
    (label, r), = res.items()
    assert label == f"tiny-{device}-disk-test" and r["commit"] == "test" and r["torch"]
    (d,), md = r["depths"], out.with_suffix(".md").read_text()
    assert not (tmp_path / "work" / "tiny-L1").exists()  # the pair is deleted once measured
    assert not (tmp_path / "work" / "out").exists()       # and every output
    return r, d, md


def _check_runs(d):
    runs = d["runs"]
    assert set(runs) >= {"unaligned", "aligned"} and d["write"]["seconds"] > 0 and d["params"] > 0
    for name, x in runs.items():
        assert x["wall_s"] > 0 and x["peak_rss_gb"] > 0.05 and x["mode"] == "streaming"
        assert 0 <= x["inputs_in_page_cache"] <= 1
        c = x["check"]
        assert c["ok"] and not c["non_bf16"] and c["from_pretrained"]["ok"], (name, c)
        assert c["from_pretrained"]["dtypes"] == ["torch.bfloat16"]
        assert x["read_x_pair"] >= 1.0 and x["out_bytes"] > 0
    u, al = runs["unaligned"], runs["aligned"]
    assert u["samples_vs_exact_average"] == 0.0      # the unaligned merge is bf16(A/2 + B/2)
    assert al["samples_vs_unaligned"] > 1e-3           # the aligned one is another model
    assert al["align_seconds"]["sweeps"] >= 1 and al["timings"]["align"] > 0
    assert sum(al["solver_devices"].values()) > 0 and not u["solver_devices"]
    assert d["ratio"] > 0
    return al


@pytest.mark.slow
def test_bench_device_disk_tiny_on_the_cpu(tmp_path):
    r, d, md = _run(tmp_path, "cpu", extra=["--discrete-layers", "1"])
    al = _check_runs(d)
    disc = d["runs"]["aligned, until discrete"]
    assert (disc["until"], al["until"]) == ("discrete", "gap")
    assert 1 <= disc["align_seconds"]["sweeps"] <= al["align_seconds"]["sweeps"]
    assert set(al["solver_devices"]) == {"cpu"} and al["peak_gpu_allocated_gb"] is None
    st = d["runs"]["aligned_staged"]["stages"]
    assert st["read"]["calls"] > 0 and any(k.startswith("similarity") for k in st)
    assert r["peaks"]["mm_float32_gflops"] > 0
    assert "| 1 | 0.00 B |" in md and "aligned_staged" in md and "Stages, aligned_staged at 1 layers" in md


@pytest.mark.slow
def test_bench_device_disk_tiny_on_a_device(tmp_path):
    """On ``fakegpu`` (a device that is not the CPU): every solver is given device tensors and
    the alignment's elements live there."""
    r, d, md = _run(tmp_path, "fakegpu", stages="", extra=["--budget-runs", "1:5MB"])
    al = _check_runs(d)
    for x in (al, d["runs"]["aligned, budget 5MB"]):
        assert set(x["solver_devices"]) == {"fakegpu"}, x["solver_devices"]
        assert x["element_devices"] == ["fakegpu"] and r["peaks"] is None
    # a budget of 5 MB (above the plan's 4.24 MB floor; 625 KB caches per model) reaches the
    # engine: it reads the pair again and again where the default caches hold the whole tiny
    # pair (read once to align, once to write)
    assert al["read_x_pair"] == pytest.approx(2.0, abs=0.01)
    assert d["runs"]["aligned, budget 5MB"]["read_x_pair"] > 3
    assert d["runs"]["aligned, budget 5MB"]["samples_vs_unaligned"] == al["samples_vs_unaligned"]


def test_a_failed_run_is_recorded_and_the_next_one_goes_on(tmp_path, monkeypatch):
    """A run that raises (out of device memory, say) is recorded with its error; the runs after
    it are still measured."""
    import symgraph.app.run as R
    real = R.run_merge

    def failing(cfg, **kw):
        if cfg.align == "weights":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, **kw)
    monkeypatch.setattr(R, "run_merge", failing)
    r, d, md = _run(tmp_path, "cpu", stages="", extra=["--aligned-first", "--load-check-gb", "0"])
    assert list(d["runs"]) == ["aligned", "unaligned"]
    assert d["runs"]["aligned"]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert d["runs"]["unaligned"]["check"]["ok"] and "ratio" not in d
    assert "**failed**: RuntimeError: CUDA out of memory" in md


@pytest.mark.slow
def test_the_pair_writer_in_parallel_writes_the_same_bytes(tmp_path):
    from benchmarks.scale.checkpoints import llama_config, write_checkpoint, write_checkpoints
    cfg = llama_config("tiny", 1)
    write_checkpoint(tmp_path / "one", cfg, 3, max_shard_size="2MB")
    info = write_checkpoints([(tmp_path / "par", 3), (tmp_path / "other", 4)], cfg, 2, max_shard_size="2MB")
    assert [i["shards"] for i in info] == [3, 3] and info[0]["workers"] == 2
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "par").iterdir()) and len(files) == 6
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "one", tmp_path / "par", files, shallow=False)
    assert not mismatch and not errors
    assert not filecmp.cmp(tmp_path / "par" / files[2], tmp_path / "other" / files[2], shallow=False)

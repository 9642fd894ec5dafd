"""Random LLaMA-shaped bf16 checkpoints written tensor by tensor from a meta-device model, laid
out as ``save_pretrained`` lays them out, helpers over checkpoint directories, page-cache
control of their files and the read-throughput loop."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

from ..provenance import REPO_ROOT
from .common import ENTRY, GB, SHAPES, SHARD_SIZE, child_env, log, measure


def llama_config(shape: str, layers: int | None = None):
    from transformers import LlamaConfig
    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return LlamaConfig(**kw)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` of the model with seed ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def make_tensor(name: str, shape, seed: int):
    """The bf16 value of one tensor: ones for 1-D (norm) weights, else seeded ``N(0,1) * 0.02``."""
    import torch
    if len(shape) == 1:
        return torch.ones(tuple(shape), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randn(tuple(shape), generator=g).mul_(0.02).to(torch.bfloat16)


def write_checkpoint(path, config, seed: int, max_shard_size=SHARD_SIZE) -> dict:
    """Write a random bf16 ``LlamaForCausalLM`` checkpoint into ``path`` as
    ``save_pretrained(max_shard_size=...)`` lays it out, one tensor at a time (the model itself
    lives on the meta device). Written into a temporary sibling and renamed into place."""
    return write_checkpoints([(path, seed)], config, 1, max_shard_size)[0]


def write_checkpoints(jobs, config, workers: int = 1, max_shard_size=SHARD_SIZE) -> list:
    """:func:`write_checkpoint` for each ``(path, seed)`` of ``jobs``, their shards written by
    ``workers`` processes at once (spawned, one thread each; 1: in this process, one shard
    after another). A tensor's value depends only on its name and its model's seed, so the
    files are the same bytes whatever the number of workers. ``seconds``: the wall time of all
    the jobs together (the same for each)."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    sd = model.state_dict()
    split = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    tmps = []
    for path, _ in jobs:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tmps.append(tmp)
    shards = [(str(tmp / f), [(n, tuple(sd[n].shape)) for n in names], seed)
              for tmp, (_, seed) in zip(tmps, jobs) for f, names in split.filename_to_tensors.items()]
    shards.sort(key=lambda s: -sum(math.prod(shape) for _, shape in s[1]))  # largest first: no long tail
    t = time.perf_counter()
    if workers <= 1:
        for s in shards:
            _write_shard(*s)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(workers, len(shards)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_thread) as pool:
            list(pool.map(_write_shard, *zip(*shards)))
    out = []
    for (path, _), tmp in zip(jobs, tmps):
        path = Path(path)
        if split.is_sharded:
            index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        cfg = model.config
        cfg.architectures = [type(model).__name__]
        cfg.dtype = torch.bfloat16  # what save_pretrained records for a bf16 model
        cfg.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(str(tmp))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        out.append({"bytes": dir_bytes(path), "shards": len(split.filename_to_tensors),
                    "parameters": model.num_parameters()})
    seconds = time.perf_counter() - t
    return [dict(o, seconds=seconds, workers=max(1, workers)) for o in out]


def _one_thread():
    import torch
    torch.set_num_threads(1)


def _write_shard(file: str, tensors, seed: int) -> None:
    """One shard file: ``tensors`` ``[(name, shape)]`` of the model with seed ``seed``."""
    from safetensors.torch import save_file
    shard = {n: make_tensor(n, shape, seed) for n, shape in tensors}
    save_file(shard, file, metadata={"format": "pt"})


def model_sizes(config) -> dict:
    """Parameter and byte counts (bf16) of the whole model, one decoder layer and the rest."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) if config.num_hidden_layers else 0
    return {"parameters": total, "bytes": 2 * total, "layer_parameters": layer, "layer_bytes": 2 * layer,
            "nonlayer_bytes": 2 * (total - layer * config.num_hidden_layers)}


def ensure_pair(work: Path, shape: str, layers: int | None, seeds=(0, 1), workers: int = 0) -> dict:
    """The pair directory of ``shape`` (written now, or reused when its ``pair.json`` matches);
    ``workers`` > 0: both written by that many processes at once (:func:`write_checkpoints`),
    else each by one measured child process (its peak RSS recorded)."""
    config = llama_config(shape, layers)
    d = work / f"{shape}-L{config.num_hidden_layers}"
    spec = {"shape": shape, "config": SHAPES[shape] | {"num_hidden_layers": config.num_hidden_layers},
            "seeds": list(seeds), "max_shard_size": SHARD_SIZE, "init": "normal*0.02, norms ones",
            "format": 1}
    marker = d / "pair.json"
    if marker.exists():
        try:
            old = json.loads(marker.read_text())
        except ValueError:
            old = {}
        if old.get("spec") == spec and all((d / m / "config.json").exists() for m in ("a", "b")):
            log(f"  reusing {d}")
            return {"dir": str(d), "a": str(d / "a"), "b": str(d / "b"), "written": False, **old["written"]}
    d.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    written = {}
    if workers > 0:
        log(f"  writing {d / 'a'}, {d / 'b'} (seeds {seeds[0]}, {seeds[1]}; {workers} processes) ...")
        t = time.perf_counter()
        for m, info in zip(("a", "b"), write_checkpoints([(d / "a", seeds[0]), (d / "b", seeds[1])], config, workers)):
            written[m] = dict(info, process_wall_s=time.perf_counter() - t)
        log(f"    {2 * written['a']['bytes'] / GB:.2f} GB in {written['a']['seconds']:.1f} s")
    for m, seed in zip(("a", "b"), seeds if workers <= 0 else ()):
        log(f"  writing {d / m} (seed {seed}) ...")
        # in a child process: the benchmark's own process stays small, and the writer's peak RSS
        # shows it never holds a whole model
        r = measure([sys.executable, "-m", ENTRY, "--_write", str(d / m), shape,
                     str(config.num_hidden_layers), str(seed)], env=child_env(), cwd=REPO_ROOT)
        if r["rc"] != 0:
            raise RuntimeError(f"writing {d / m} failed (rc {r['rc']}): {r.get('error')}")
        written[m] = json.loads(r["stdout"].strip().splitlines()[-1])
        written[m].update(process_wall_s=r["wall_s"], peak_rss_gb=r["peak_rss_bytes"] / GB)
        log(f"    {written[m]['bytes'] / GB:.2f} GB in {written[m]['seconds']:.1f} s, "
            f"writer peak RSS {written[m]['peak_rss_gb']:.2f} GB")
    marker.write_text(json.dumps({"spec": spec, "written": {"write": written}}, indent=1))
    return {"dir": str(d), "a": str(d / "a"), "b": str(d / "b"), "written": True, "write": written}


def dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weight_files(path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def tensor_files(path) -> dict:
    """``{tensor name: file}`` of a checkpoint directory (from its index, else its one file)."""
    path = Path(path)
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        return {k: path / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
    from safetensors import safe_open
    out = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def drop_cache(paths) -> None:
    """Evict these files' pages from the page cache (``posix_fadvise(DONTNEED)``; only clean
    pages go, so dirty ones are flushed first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths) -> None:
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def read_all(path) -> dict:
    """Read every tensor of a checkpoint with ``safe_open(..., framework="pt")``, one at a time,
    each copied into a fresh tensor (safetensors may return tensors backed by its mmap, whose
    pages are read only when touched)."""
    import torch  # noqa: F401 - imported before the clock starts (safetensors imports it lazily)
    from safetensors import safe_open
    n = nbytes = 0
    t = time.perf_counter()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                x = h.get_tensor(k).clone()  # get_tensor may hand back an mmap view; clone reads it
                nbytes += x.numel() * x.element_size()
                n += 1
                del x
    s = time.perf_counter() - t
    return {"tensors": n, "bytes": nbytes, "seconds": s, "gb_per_s": nbytes / GB / s if s else None}

"""Random LLaMA-shaped bf16 checkpoints written as ``save_pretrained`` lays them out, the helpers
over checkpoint directories and their page cache, and the checks of merge outputs."""
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
from .common import DATA_ROWS, DATA_TOKENS, ENTRY, GB, SHAPES, SHARD_SIZE, child_env, log, measure


def llama_config(shape: str, layers: int | None = None):
    from transformers import LlamaConfig
    return LlamaConfig(**SHAPES[shape] | ({} if layers is None else {"num_hidden_layers": layers}))


def make_tensor(name: str, shape, seed: int):
    """The bf16 value of one tensor: ones for 1-D (norm) weights, else ``N(0,1) * 0.02`` from a
    generator seeded by the model's ``seed`` and the tensor's ``name`` only."""
    import torch
    if len(shape) == 1:
        return torch.ones(tuple(shape), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return torch.randn(tuple(shape), generator=g).mul_(0.02).to(torch.bfloat16)


def write_checkpoint(path, config, seed: int, max_shard_size=SHARD_SIZE) -> dict:
    return write_checkpoints([(path, seed)], config, 1, max_shard_size)[0]


def write_checkpoints(jobs, config, workers: int = 1, max_shard_size=SHARD_SIZE) -> list:
    """A random bf16 ``LlamaForCausalLM`` checkpoint for each ``(path, seed)`` of ``jobs``, as
    ``save_pretrained(max_shard_size=...)`` lays it out, one tensor at a time from a meta-device
    model, written into a temporary sibling and renamed into place; its shards by ``workers``
    spawned processes at once (1: in this process; the bytes are the same either way).
    ``seconds``: the wall time of all the jobs together."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    sd = model.state_dict()
    split = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    tmps = [Path(path).with_name(f".{Path(path).name}.tmp") for path, _ in jobs]
    for tmp in tmps:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shards = [(str(tmp / f), [(n, tuple(sd[n].shape)) for n in names], seed)
              for tmp, (_, seed) in zip(tmps, jobs) for f, names in split.filename_to_tensors.items()]
    shards.sort(key=lambda s: -sum(math.prod(shape) for _, shape in s[1]))  # largest first: no long tail
    t = time.perf_counter()
    if workers <= 1:
        list(map(_write_shard, *zip(*shards)))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(workers, len(shards)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            list(pool.map(_write_shard, *zip(*shards)))
    cfg = model.config
    cfg.architectures = [type(model).__name__]
    cfg.dtype = torch.bfloat16  # what save_pretrained records for a bf16 model
    out = []
    for (path, _), tmp in zip(jobs, tmps):
        if split.is_sharded:
            index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        cfg.save_pretrained(str(tmp))
        if model.can_generate():
            model.generation_config.save_pretrained(str(tmp))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        out.append({"bytes": dir_bytes(path), "shards": len(split.filename_to_tensors),
                    "parameters": model.num_parameters()})
    seconds = time.perf_counter() - t
    return [dict(o, seconds=seconds, workers=max(1, workers)) for o in out]


def _write_shard(file: str, tensors, seed: int) -> None:
    """One shard file: ``tensors`` ``[(name, shape)]`` of the model with seed ``seed``."""
    from safetensors.torch import save_file
    save_file({n: make_tensor(n, shape, seed) for n, shape in tensors}, file, metadata={"format": "pt"})


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


def ensure_pair(work: Path, shape: str, layers: int | None, workers: int = 0, seeds=(0, 1)) -> dict:
    """The pair directory of ``shape`` (written now, or reused when its ``pair.json`` matches);
    ``workers`` > 0: both written by that many processes at once, else each by one measured
    child process (its peak RSS shows it never holds a whole model)."""
    config = llama_config(shape, layers)
    d = work / f"{shape}-L{config.num_hidden_layers}"
    paths = {"dir": str(d), "a": str(d / "a"), "b": str(d / "b")}
    spec = {"shape": shape, "config": SHAPES[shape] | {"num_hidden_layers": config.num_hidden_layers},
            "seeds": list(seeds), "max_shard_size": SHARD_SIZE, "init": "normal*0.02, norms ones", "format": 1}
    marker = d / "pair.json"
    try:
        old = json.loads(marker.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("spec") == spec and all((d / m / "config.json").exists() for m in "ab"):
        log(f"  reusing {d}")
        return {**paths, "written": False, **old["written"]}
    d.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    written = {}
    if workers > 0:
        log(f"  writing {d / 'a'}, {d / 'b'} (seeds {seeds[0]}, {seeds[1]}; {workers} processes) ...")
        t = time.perf_counter()
        infos = write_checkpoints([(d / m, seed) for m, seed in zip("ab", seeds)], config, workers)
        written = {m: dict(info, process_wall_s=time.perf_counter() - t) for m, info in zip("ab", infos)}
        log(f"    {2 * written['a']['bytes'] / GB:.2f} GB in {written['a']['seconds']:.1f} s")
    for m, seed in zip("ab", seeds if workers <= 0 else ()):
        log(f"  writing {d / m} (seed {seed}) ...")
        r = measure([sys.executable, "-m", ENTRY, "--_write", str(d / m), shape,
                     str(config.num_hidden_layers), str(seed)], env=child_env(), cwd=REPO_ROOT)
        if r["rc"] != 0:
            raise RuntimeError(f"writing {d / m} failed (rc {r['rc']}): {r.get('error')}")
        written[m] = json.loads(r["stdout"].strip().splitlines()[-1])
        written[m].update(process_wall_s=r["wall_s"], peak_rss_gb=r["peak_rss_bytes"] / GB)
        log(f"    {written[m]['bytes'] / GB:.2f} GB in {written[m]['seconds']:.1f} s, "
            f"writer peak RSS {written[m]['peak_rss_gb']:.2f} GB")
    marker.write_text(json.dumps({"spec": spec, "written": {"write": written}}, indent=1))
    return {**paths, "written": True, "write": written}


def token_data(directory, vocab: int, rows: int = DATA_ROWS) -> str:
    """``directory/data.safetensors``: ``rows`` × :data:`DATA_TOKENS` random token ids (seed 0),
    the data of the methods that read data (their statistics' cost, not their quality, is measured)."""
    import torch
    from safetensors.torch import save_file
    path = Path(directory) / "data.safetensors"
    save_file({"input_ids": torch.randint(0, vocab, (rows, DATA_TOKENS), generator=torch.Generator().manual_seed(0))},
              str(path))
    return str(path)


def dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weight_files(path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def drop_cache(paths) -> None:
    """These files' pages out of the page cache (``posix_fadvise(DONTNEED)``, after a flush)."""
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
    """Every tensor of a checkpoint read through ``safe_open``, one at a time, each cloned (an mmap
    view's pages are read only when touched)."""
    import torch  # noqa: F401 - imported before the clock starts (safetensors imports it lazily)
    from safetensors import safe_open
    n = nbytes = 0
    t = time.perf_counter()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                x = h.get_tensor(k).clone()
                nbytes += x.numel() * x.element_size()
                n += 1
    s = time.perf_counter() - t
    return {"tensors": n, "bytes": nbytes, "seconds": s, "gb_per_s": nbytes / GB / s if s else None}


def tensor_files(path) -> dict:
    """``{tensor name: shard file}`` of a checkpoint directory, from its headers (refused where the
    index and the shards disagree: :func:`symgraph.checkpoints.loading.read_layout`)."""
    from symgraph.checkpoints.loading import read_layout
    return read_layout(str(path)).files


def check_output(out, ref, load_check: bool) -> dict:
    """Names, shapes and dtypes of ``out``'s tensors against the input ``ref``, from the headers
    (``read_layout``: index and shards agree); with ``load_check``, a full ``from_pretrained``."""
    import torch
    from symgraph.checkpoints.loading import read_layout
    try:
        got, want = read_layout(str(out)), read_layout(str(ref))
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    res = {"ok": False, "index": (Path(out) / "model.safetensors.index.json").exists(),
           "missing": sorted(set(want.shapes) - set(got.shapes))[:10],
           "unexpected": sorted(set(got.shapes) - set(want.shapes))[:10],
           "non_bf16": [f"{k}:{d}" for k, d in got.dtypes.items() if d != torch.bfloat16][:10],
           "shape_mismatch": [k for k, s in got.shapes.items() if k in want.shapes and s != want.shapes[k]][:10],
           "tensors": len(got.shapes)}
    res["ok"] = not (res["missing"] or res["unexpected"] or res["non_bf16"] or res["shape_mismatch"])
    if load_check:
        res["from_pretrained"] = load_check_dir(out)
        res["ok"] = res["ok"] and res["from_pretrained"]["ok"]
    return res


def load_check_dir(path) -> dict:
    """``AutoModelForCausalLM.from_pretrained(path)``: every key loaded, every parameter bf16."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    info = {k: sorted(map(str, v))[:10] for k, v in info.items() if k != "error_msgs"}
    return {"ok": not any(info.values()) and dtypes == [str(torch.bfloat16)], "dtypes": dtypes, **info}


def compare_outputs(sym, mk, a, b, chunk: int = 1 << 24) -> dict:
    """The symgraph ``--align none`` output streamed against mergekit's, and both against the exact
    ``bf16(0.5 A + 0.5 B)`` (fp32 arithmetic): one tensor of each checkpoint in memory at a time,
    compared ``chunk`` elements at a time; within one ulp: ``|d| <= 2^-7 max(|x|, |y|)``."""
    import torch
    from safetensors import safe_open
    fs, fm, fa, fb = (tensor_files(p) for p in (sym, mk, a, b))
    if set(fs) != set(fa) or set(fm) != set(fa):
        return {"ok": False, "error": "tensor names differ", "only_in_symgraph": sorted(set(fs) - set(fm))[:10],
                "only_in_mergekit": sorted(set(fm) - set(fs))[:10]}

    def get(files, k):
        with safe_open(str(files[k]), framework="pt") as h:
            return h.get_tensor(k)

    out = {"tensors": len(fa), "elements": 0}
    acc = {k: {"max_abs_diff": 0.0, "elements_differ": 0, "within_1ulp": True, "worst": None}
           for k in ("symgraph_vs_mergekit", "symgraph_vs_exact", "mergekit_vs_exact")}
    t = time.perf_counter()
    for k in sorted(fa):
        s, m = get(fs, k), get(fm, k)
        if s.shape != m.shape or s.dtype != m.dtype:
            return {"ok": False, "error": f"{k}: {tuple(s.shape)} {s.dtype} vs {tuple(m.shape)} {m.dtype}"}
        ta, tb, s, m = get(fa, k).reshape(-1), get(fb, k).reshape(-1), s.reshape(-1), m.reshape(-1)
        out["elements"] += s.numel()
        for i in range(0, s.numel(), chunk):  # fp32 temporaries of one chunk only
            c = slice(i, i + chunk)
            ref = (0.5 * ta[c].float() + 0.5 * tb[c].float()).to(torch.bfloat16)
            for key, (x, y) in (("symgraph_vs_mergekit", (s[c], m[c])), ("symgraph_vs_exact", (s[c], ref)),
                                ("mergekit_vs_exact", (m[c], ref))):
                x, y = x.float(), y.float()
                d, r = (x - y).abs(), acc[key]
                if (mx := float(d.max())) > r["max_abs_diff"]:
                    r["max_abs_diff"], r["worst"] = mx, k
                r["elements_differ"] += int((d != 0).sum())
                r["within_1ulp"] = r["within_1ulp"] and bool((d <= 2.0 ** -7 * torch.maximum(x.abs(), y.abs())).all())
    out.update(acc, seconds=time.perf_counter() - t, ok=acc["symgraph_vs_mergekit"]["within_1ulp"])
    return out

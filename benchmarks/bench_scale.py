"""Scale benchmark: ``symgraph merge`` on LLaMA-shaped bf16 checkpoints against mergekit's
linear merge of the same pair, in the same run.

    python -m benchmarks.bench_scale [--shapes tiny,1b,7b] [--layers N] [--work DIR]
                                     [--out benchmarks/results/scale.json]

Checkpoints. For each shape (``tiny``: 2 layers, hidden 256; ``1b``: TinyLlama-1.1B, 2048/5632,
22 layers, 32 heads, 4 KV heads; ``7b``: Llama-2-7B, 4096/11008, 32 layers, 32 heads, 32 KV
heads; vocab 32000; ``--layers`` overrides the depth) a pair of random bf16 checkpoints is
written once under ``--work`` and reused while its ``pair.json`` matches. The model is built on
the ``meta`` device, split into shards exactly as ``save_pretrained(max_shard_size="1GB")``
splits it (``huggingface_hub.split_torch_state_dict_into_shards``), and each shard is filled one
tensor at a time with seeded values (``normal * 0.02`` for matrices, ones for norm weights; the
seed of a tensor is a function of the model's seed and the tensor's name, A and B use different
model seeds) and written with ``safetensors.torch.save_file``, next to the
``model.safetensors.index.json`` (``metadata.total_parameters``/``total_size``, ``weight_map``),
``config.json`` and ``generation_config.json`` that ``save_pretrained`` writes. The writer runs
in a child process (its wall time and peak RSS are recorded with the pair): its peak memory is
about one shard, not one model.

Stages. Every stage runs in its own subprocess under a tiny measuring wrapper (a Python process
that starts exactly one child, waits for it and prints its own
``getrusage(RUSAGE_CHILDREN)``): the wrapper's ``ru_maxrss`` is then the child's peak resident
set (the largest of the child and any descendant it waited for; file-backed pages a tool maps,
e.g. safetensors' mmap, count, as they do in the kernel's RSS), ``ru_utime + ru_stime`` its CPU
time; wall time is measured around start and wait. A stage past ``--timeout`` (default 3600 s)
is killed with its process group; a failing or killed stage (the kernel's OOM killer shows as
rc -9) is recorded with its return code and the last line of its stderr, and the run goes on.

* ``read_cold`` / ``read_warm``: read every tensor of model A with ``safetensors.safe_open(...,
  framework="pt").get_tensor(...).clone()`` one tensor at a time (the clone makes sure every
  byte is read: the tensor may be an mmap view; GB/s over the loop, imports excluded), once
  after dropping A's files from the page cache (``posix_fadvise(DONTNEED)``, per file, no
  global cache drop) and once right after, from the cache.
* ``mergekit_linear``: ``mergekit-yaml`` (mergekit 0.1.5 in its own venv, created on demand at
  ``<work>/mergekit-venv``; skipped with a message when that fails) with ``merge_method:
  linear``, weights 0.5/0.5, ``dtype``/``out_dtype`` bfloat16, on CPU with its lowest-memory
  settings: ``--lazy-unpickle --no-async-write --no-copy-tokenizer --out-shard-size 500M``
  (parameters per output shard, about 1 GB in bf16, like the inputs), no CUDA.
* ``symgraph_none`` / ``symgraph_weights``: ``symgraph merge A B --out O --align none|weights``.
* ``symgraph_activations``: ``symgraph merge A B --out O --align activations --data D`` with
  ``D`` :data:`DATA_ROWS` random rows of :data:`DATA_TOKENS` token ids (fixed seed): out of
  core, the two graphs run side by side from the checkpoints, statistics in passes.

Before each merge stage the inputs' page-cache state is set by ``--cache``: ``warm`` (default)
reads both inputs through once, ``cold`` drops them (as above). GB is 10^9 bytes throughout.

Checks. Every output must hold exactly the input's tensor names with the input's shapes, all
bf16 (from the safetensors headers, no data read) and an index whose ``weight_map`` points at
files that hold them; outputs of shapes up to ``--load-check-gb`` (default 0.5 GB per model) are
also loaded with ``AutoModelForCausalLM.from_pretrained`` (no missing/unexpected/mismatched
keys, every parameter bf16). ``symgraph_none`` is compared with mergekit's output tensor by
tensor (streamed: one tensor of each checkpoint in memory at a time), and both with the exact
reference ``bf16(0.5 * A + 0.5 * B)`` computed in fp32: max abs difference, elements that differ, and
whether every element is within one bf16 ulp (``|d| <= 2^-7 max(|x|, |y|)``).

Reported per stage: wall s, CPU s, peak RSS GB, bytes in/out, GB/s, seconds per layer, and the
time and peak-RSS ratios against ``mergekit_linear`` of the same run; with ``--layers`` below
the shape's depth, also the full-depth model size. Results go to ``--out`` (JSON) and a
Markdown table next to it (``scale.md``), with the machine (cores, RAM, CPU, torch, device).
``--append`` keeps other (shape, layers) entries of an existing ``--out``. Merge outputs are
deleted after the checks unless ``--keep-outputs``; the pairs stay in ``--work``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

from .provenance import REPO_ROOT, git_state

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "scale.json"
DEFAULT_WORK = "/tmp/symgraph-scale"
GB = 1e9
SHARD_SIZE = "1GB"
MERGEKIT_VERSION = "0.1.5"
MERGEKIT_TORCH = "torch==2.13.0"  # the local CPU wheel; installed first so pip does not pull CUDA
MERGEKIT_SHARD_PARAMS = "500M"    # mergekit's --out-shard-size counts parameters (≈1 GB in bf16)

_COMMON = dict(vocab_size=32000, hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False)
#: The shapes: LlamaConfig keyword arguments.
SHAPES = {
    "tiny": dict(_COMMON, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, vocab_size=4096),
    "1b": dict(_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
               rms_norm_eps=1e-5),
    "7b": dict(_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
               rms_norm_eps=1e-5),
}
STAGES = ("read_cold", "read_warm", "mergekit_linear", "symgraph_none", "symgraph_weights",
          "symgraph_activations")
DATA_ROWS, DATA_TOKENS = 32, 128  # symgraph_activations' data: 4 batches of 8 rows

#: The measuring wrapper: runs one child (its stdout/stderr to files, own process group), kills
#: the group on timeout, then prints wall time and RUSAGE_CHILDREN (= that child's figures).
_WRAPPER = r"""
import json, os, resource, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
t0 = time.perf_counter()
timed_out = False
with open(spec["stdout"], "wb") as o, open(spec["stderr"], "wb") as e:
    p = subprocess.Popen(spec["cmd"], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                         env=spec.get("env"), cwd=spec.get("cwd"), start_new_session=True)
    try:
        rc = p.wait(timeout=spec.get("timeout"))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = p.wait()
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "timed_out": timed_out, "wall_s": wall, "maxrss_kb": ru.ru_maxrss,
                  "user_s": ru.ru_utime, "sys_s": ru.ru_stime}))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- measuring ---------------------------------------------------------------------------------


def measure(cmd, *, timeout: float | None = None, env=None, cwd=None, log_prefix=None) -> dict:
    """Run ``cmd`` in a fresh wrapper process; returns rc, timed_out, wall_s, user_s, sys_s,
    peak_rss_bytes (the child's ``ru_maxrss``), the child's stdout/stderr log paths and, on
    failure, ``error`` (the last non-empty stderr line)."""
    import tempfile
    own_logs = log_prefix is None
    if own_logs:
        log_prefix = os.path.join(tempfile.mkdtemp(prefix="bench-scale-"), "child")
    spec = {"cmd": [str(c) for c in cmd], "stdout": f"{log_prefix}.stdout", "stderr": f"{log_prefix}.stderr",
            "timeout": timeout, "env": env, "cwd": str(cwd) if cwd else None}
    res = subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(spec)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"measuring wrapper failed: {res.stderr.strip()[-500:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    kb = r.pop("maxrss_kb")
    r["peak_rss_bytes"] = kb if sys.platform == "darwin" else kb * 1024
    r["stdout_log"], r["stderr_log"] = spec["stdout"], spec["stderr"]
    if r["rc"] != 0 or r["timed_out"]:
        r["error"] = ("timed out after %.0f s" % timeout) if r["timed_out"] else _last_line(spec["stderr"])
    if own_logs:
        r["stdout"] = Path(spec["stdout"]).read_text(errors="replace")
        r["stderr"] = Path(spec["stderr"]).read_text(errors="replace")
        shutil.rmtree(os.path.dirname(log_prefix), ignore_errors=True)
        del r["stdout_log"], r["stderr_log"]
    return r


_PROGRESS_BAR = re.compile(r"[^\n]*?\|[^|\n]*\|\s*\d+/\d+ \[[^\]\n]*\]")  # a tqdm line


def _last_line(path) -> str | None:
    """The last non-empty line of a log, tqdm progress bars taken out."""
    try:
        text = Path(path).read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return None
    lines = [ln.strip() for ln in _PROGRESS_BAR.sub("\n", text).splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][-500:] if lines else None


# --- checkpoints -------------------------------------------------------------------------------


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
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM
    path = Path(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    sd = model.state_dict()
    split = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t = time.perf_counter()
    for filename, names in split.filename_to_tensors.items():
        shard = {n: make_tensor(n, sd[n].shape, seed) for n in names}
        save_file(shard, str(tmp / filename), metadata={"format": "pt"})
        del shard
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
    seconds = time.perf_counter() - t
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return {"seconds": seconds, "bytes": dir_bytes(path), "shards": len(split.filename_to_tensors),
            "parameters": model.num_parameters()}


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


def ensure_pair(work: Path, shape: str, layers: int | None, seeds=(0, 1)) -> dict:
    """The pair directory of ``shape`` (written now, or reused when its ``pair.json`` matches)."""
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
    for m, seed in zip(("a", "b"), seeds):
        log(f"  writing {d / m} (seed {seed}) ...")
        # in a child process: the benchmark's own process stays small, and the writer's peak RSS
        # shows it never holds a whole model
        r = measure([sys.executable, "-m", "benchmarks.bench_scale", "--_write", str(d / m), shape,
                     str(config.num_hidden_layers), str(seed)], env=_env(), cwd=REPO_ROOT)
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


# --- page cache --------------------------------------------------------------------------------


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


# --- mergekit ----------------------------------------------------------------------------------


def ensure_mergekit(venv: Path) -> tuple[Path | None, str]:
    """``(mergekit-yaml, message)``: mergekit in its own venv, created on demand."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe, f"mergekit venv {venv}"
    log(f"  creating {venv} (torch CPU wheel, then mergekit=={MERGEKIT_VERSION}) ...")
    logf = venv.parent / "mergekit-install.log"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)], pip + [MERGEKIT_TORCH],
             pip + [f"mergekit=={MERGEKIT_VERSION}"]]
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        with open(logf, "w") as lf:
            for cmd in steps:
                lf.write("$ " + " ".join(cmd) + "\n")
                lf.flush()
                r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT)
                if r.returncode != 0:
                    return None, (f"could not install mergekit ({cmd[-1]} exited {r.returncode}; "
                                  f"see {logf}): {_last_line(logf)}")
    except OSError as e:
        return None, f"could not create the mergekit venv {venv}: {e}"
    if not exe.exists():
        return None, f"mergekit installed but {exe} is missing (see {logf})"
    return exe, f"mergekit venv {venv} (created now)"


def mergekit_config(a, b) -> str:
    import yaml
    cfg = {"merge_method": "linear", "dtype": "bfloat16", "out_dtype": "bfloat16",
           "models": [{"model": str(a), "parameters": {"weight": 0.5}},
                      {"model": str(b), "parameters": {"weight": 0.5}}]}
    return yaml.safe_dump(cfg, sort_keys=False)


def mergekit_version(venv: Path) -> str | None:
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import importlib.metadata as m; print(m.version('mergekit'), m.version('torch'), "
                        "m.version('transformers'))"], capture_output=True, text=True)
    return r.stdout.strip() or None


# --- checks ------------------------------------------------------------------------------------


def check_output(out, ref, load_check: bool) -> dict:
    """Names, shapes and dtypes of ``out``'s tensors against the input ``ref`` (headers only);
    with ``load_check``, a full ``from_pretrained``."""
    from safetensors import safe_open
    res = {"ok": False}
    try:
        files, ref_files = tensor_files(out), tensor_files(ref)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    res["index"] = (Path(out) / "model.safetensors.index.json").exists()
    res["missing"] = sorted(set(ref_files) - set(files))[:10]
    res["unexpected"] = sorted(set(files) - set(ref_files))[:10]
    bad_dtype, bad_shape, absent = [], [], []
    handles = {}
    try:
        for k, f in files.items():
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            h = handles[f]
            if k not in h.keys():
                absent.append(k)
                continue
            sl = h.get_slice(k)
            if sl.get_dtype() != "BF16":
                bad_dtype.append(f"{k}:{sl.get_dtype()}")
            if k in ref_files:
                with safe_open(str(ref_files[k]), framework="pt") as r:
                    if list(r.get_slice(k).get_shape()) != list(sl.get_shape()):
                        bad_shape.append(k)
    finally:
        handles.clear()
    res.update(not_in_file=absent[:10], non_bf16=bad_dtype[:10], shape_mismatch=bad_shape[:10],
               tensors=len(files))
    res["ok"] = not (res["missing"] or res["unexpected"] or absent or bad_dtype or bad_shape)
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
    ok = not any(info.values()) and dtypes == [str(torch.bfloat16)]
    return {"ok": ok, "dtypes": dtypes, **info}


def compare_outputs(sym, mk, a, b, chunk: int = 1 << 24) -> dict:
    """Stream the symgraph ``--align none`` output against mergekit's and both against the exact
    ``bf16(0.5 A + 0.5 B)`` (fp32 arithmetic): one tensor of each of the four checkpoints in
    memory at a time, compared ``chunk`` elements at a time."""
    import torch
    from safetensors import safe_open
    fs, fm, fa, fb = (tensor_files(p) for p in (sym, mk, a, b))
    names = sorted(fa)
    if set(fs) != set(fa) or set(fm) != set(fa):
        return {"ok": False, "error": "tensor names differ",
                "only_in_symgraph": sorted(set(fs) - set(fm))[:10],
                "only_in_mergekit": sorted(set(fm) - set(fs))[:10]}

    def get(files, k):
        with safe_open(str(files[k]), framework="pt") as h:
            return h.get_tensor(k)

    def diff(x, y):
        x, y = x.float(), y.float()
        d = (x - y).abs()
        ulp = d <= 2.0 ** -7 * torch.maximum(x.abs(), y.abs())
        return float(d.max()), int((d != 0).sum()), bool(ulp.all())

    out = {"tensors": len(names), "elements": 0}
    acc = {k: {"max_abs_diff": 0.0, "elements_differ": 0, "within_1ulp": True, "worst": None}
           for k in ("symgraph_vs_mergekit", "symgraph_vs_exact", "mergekit_vs_exact")}
    t = time.perf_counter()
    for k in names:
        s, m = get(fs, k), get(fm, k)
        if s.shape != m.shape or s.dtype != m.dtype:
            return {"ok": False, "error": f"{k}: {tuple(s.shape)} {s.dtype} vs {tuple(m.shape)} {m.dtype}"}
        ta, tb = get(fa, k).reshape(-1), get(fb, k).reshape(-1)
        s, m = s.reshape(-1), m.reshape(-1)
        out["elements"] += s.numel()
        for i in range(0, s.numel(), chunk):  # fp32 temporaries of one chunk only
            c = slice(i, i + chunk)
            ref = (0.5 * ta[c].float() + 0.5 * tb[c].float()).to(torch.bfloat16)
            for key, (x, y) in (("symgraph_vs_mergekit", (s[c], m[c])), ("symgraph_vs_exact", (s[c], ref)),
                                ("mergekit_vs_exact", (m[c], ref))):
                mx, n, ok = diff(x, y)
                r = acc[key]
                if mx > r["max_abs_diff"]:
                    r["max_abs_diff"], r["worst"] = mx, k
                r["elements_differ"] += n
                r["within_1ulp"] = r["within_1ulp"] and ok
        del s, m, ta, tb
    out.update(acc)
    out["seconds"] = time.perf_counter() - t
    out["ok"] = acc["symgraph_vs_mergekit"]["within_1ulp"]
    return out


# --- the run -----------------------------------------------------------------------------------


def machine_info() -> dict:
    import torch
    mem = None
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem = int(ln.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor() or None
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers
    return {"cores": os.cpu_count(), "ram_gb": mem / GB if mem else None, "cpu": cpu,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": "cpu",
            "cuda_available": torch.cuda.is_available(), "platform": platform.platform()}




def _symgraph_cmd() -> list:
    exe = Path(sys.executable).parent / "symgraph"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from symgraph.cli import main; sys.exit(main())"]


def _env(**extra) -> dict:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_shape(shape: str, layers: int | None, work: Path, stages, timeout: float, cache: str,
              mergekit_venv: Path, load_check_gb: float, keep_outputs: bool) -> dict:
    config = llama_config(shape, layers)
    n_layers = config.num_hidden_layers
    full = model_sizes(llama_config(shape))
    sizes = model_sizes(config)
    log(f"[{shape}, {n_layers} layers] {sizes['parameters'] / 1e9:.3f} B parameters, "
        f"{sizes['bytes'] / GB:.2f} GB per model")
    pair = ensure_pair(work, shape, layers)
    a, b = pair["a"], pair["b"]
    inputs = [str(f) for m in (a, b) for f in weight_files(m)]
    bytes_in = sum(os.path.getsize(f) for f in inputs)
    rec = {"shape": shape, "layers": n_layers, "full_layers": SHAPES[shape]["num_hidden_layers"],
           "config": SHAPES[shape] | {"num_hidden_layers": n_layers}, "dtype": "bfloat16",
           **sizes, "full_model_parameters": full["parameters"], "full_model_bytes": full["bytes"],
           "bytes_on_disk_per_model": dir_bytes(a), "pair": pair, "cache": cache, "stages": {},
           "run": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "symgraph_commit": git_state(),
                   "timeout_s": timeout}}
    outdir = Path(pair["dir"]) / "out"
    outdir.mkdir(exist_ok=True)
    logdir = Path(pair["dir"]) / "logs"
    logdir.mkdir(exist_ok=True)

    def prep_cache():
        if cache == "cold":
            drop_cache(inputs)
        else:
            warm_cache(inputs)

    def finish(name, r, out=None, b_in=bytes_in):
        r["bytes_in"] = b_in
        if out is not None and r["rc"] == 0 and Path(out).exists():
            r["bytes_out"] = dir_bytes(out)
            r["out"] = str(out)
        r["peak_rss_gb"] = r["peak_rss_bytes"] / GB
        r["cpu_s"] = r["user_s"] + r["sys_s"]
        r["in_gb_per_s"] = b_in / GB / r["wall_s"] if r["wall_s"] else None
        r["seconds_per_layer"] = r["wall_s"] / n_layers
        r["ok"] = r["rc"] == 0 and not r["timed_out"]
        rec["stages"][name] = r
        status = "ok" if r["ok"] else f"FAILED rc={r['rc']}: {r.get('error')}"
        log(f"  {name:<17} {r['wall_s']:8.1f} s  peak RSS {r['peak_rss_gb']:6.2f} GB  {status}")

    # read throughput, model A only
    for name, mode in (("read_cold", "cold"), ("read_warm", "warm")):
        if name not in stages:
            continue
        files_a = [str(f) for f in weight_files(a)]
        if mode == "cold":
            drop_cache(files_a)
        else:
            warm_cache(files_a)
        r = measure([sys.executable, "-m", "benchmarks.bench_scale", "--_read", a], timeout=timeout,
                    env=_env(), cwd=REPO_ROOT, log_prefix=str(logdir / name))
        if r["rc"] == 0:
            try:
                r["read"] = json.loads(Path(r["stdout_log"]).read_text().strip().splitlines()[-1])
            except (ValueError, IndexError):
                pass
        finish(name, r, b_in=sum(os.path.getsize(f) for f in files_a))

    # mergekit
    mk_out = outdir / "mergekit_linear"
    if "mergekit_linear" in stages:
        exe, msg = ensure_mergekit(mergekit_venv)
        rec["mergekit"] = {"venv": str(mergekit_venv), "message": msg}
        if exe is None:
            log(f"  mergekit_linear    skipped: {msg}")
            rec["stages"]["mergekit_linear"] = {"skipped": msg, "ok": False}
        else:
            rec["mergekit"]["versions"] = mergekit_version(mergekit_venv)
            cfg = Path(pair["dir"]) / "mergekit.yml"
            cfg.write_text(mergekit_config(a, b))
            shutil.rmtree(mk_out, ignore_errors=True)
            cmd = [exe, str(cfg), str(mk_out), "--lazy-unpickle", "--no-async-write", "--no-copy-tokenizer",
                   "--no-cuda", "--out-shard-size", MERGEKIT_SHARD_PARAMS, "--quiet"]
            prep_cache()
            r = measure(cmd, timeout=timeout, env=_env(CUDA_VISIBLE_DEVICES=""), cwd=pair["dir"],
                        log_prefix=str(logdir / "mergekit_linear"))
            r["cmd"] = [str(c) for c in cmd]
            finish("mergekit_linear", r, mk_out)

    # symgraph
    for align in ("none", "weights", "activations"):
        name = f"symgraph_{align}"
        if name not in stages:
            continue
        out = outdir / name
        shutil.rmtree(out, ignore_errors=True)
        cmd = _symgraph_cmd() + ["merge", a, b, "--out", str(out), "--align", align]
        if align == "activations":
            cmd += ["--data", _token_data(Path(pair["dir"]), config.vocab_size)]
        prep_cache()
        r = measure(cmd, timeout=timeout, env=_env(), cwd=REPO_ROOT, log_prefix=str(logdir / name))
        r["cmd"] = [str(c) for c in cmd]
        finish(name, r, out)

    # ratios against mergekit
    mk = rec["stages"].get("mergekit_linear", {})
    for name, r in rec["stages"].items():
        if name.startswith("symgraph") and mk.get("ok") and r.get("ok"):
            r["time_ratio_vs_mergekit"] = r["wall_s"] / mk["wall_s"]
            r["rss_ratio_vs_mergekit"] = r["peak_rss_bytes"] / mk["peak_rss_bytes"]

    # checks
    load_check = sizes["bytes"] <= load_check_gb * GB
    checks = {"from_pretrained": load_check}
    t = time.perf_counter()
    checks["inputs"] = {m: check_output(p, a, load_check) for m, p in (("a", a), ("b", b))}
    for name in ("mergekit_linear", "symgraph_none", "symgraph_weights", "symgraph_activations"):
        r = rec["stages"].get(name, {})
        if r.get("ok") and r.get("out"):
            checks[name] = check_output(r["out"], a, load_check)
    st = rec["stages"]
    if st.get("symgraph_none", {}).get("ok") and st.get("mergekit_linear", {}).get("ok"):
        checks["none_vs_mergekit"] = compare_outputs(outdir / "symgraph_none", mk_out, a, b)
    checks["seconds"] = time.perf_counter() - t
    rec["checks"] = checks
    for k, v in checks.items():
        if isinstance(v, dict) and "ok" in v:
            log(f"  check {k:<17} {'ok' if v['ok'] else 'FAILED'}"
                + (f"  (max |symgraph - mergekit| {v['symgraph_vs_mergekit']['max_abs_diff']:.3g})"
                   if k == "none_vs_mergekit" and "symgraph_vs_mergekit" in v else ""))
    if not keep_outputs:
        shutil.rmtree(outdir, ignore_errors=True)
    return rec


def _token_data(directory: Path, vocab: int) -> str:
    """A data file of :data:`DATA_ROWS` × :data:`DATA_TOKENS` random token ids (seed 0)."""
    import torch
    from safetensors.torch import save_file
    path = directory / "data.safetensors"
    ids = torch.randint(0, vocab, (DATA_ROWS, DATA_TOKENS), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(path))
    return str(path)


# --- reporting ---------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _writer_note(pair: dict) -> str:
    w = pair.get("write") or {}
    if not w or any("peak_rss_gb" not in v for v in w.values()):
        return ""
    return (f" Pair {'written now' if pair.get('written') else 'reused'}: "
            f"{max(v['seconds'] for v in w.values()):.1f} s per model, "
            f"writer peak RSS {max(v['peak_rss_gb'] for v in w.values()):.2f} GB.")


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Scale benchmark: `symgraph merge` vs mergekit (linear, bf16)", "",
             f"Machine: {m['cores']} cores ({m.get('cpu')}), {_f(m['ram_gb'], '{:.1f}')} GB RAM, "
             f"device {m['device']}, torch {m['torch']}, transformers {m['transformers']}, "
             f"Python {m['python']}.", "",
             "Each stage is a separate process; peak RSS is the child's `ru_maxrss` (file-backed "
             "mmap pages included), GB = 10^9 bytes. Ratios are against `mergekit_linear` of the "
             "same run. Written by `python -m benchmarks.bench_scale` (see its docstring).", ""]
    for rec in result["shapes"]:
        s = rec["stages"]
        mk = rec.get("mergekit", {}).get("versions")
        lines += [f"## {rec['shape']}: {rec['layers']} of {rec['full_layers']} layers, "
                  f"{rec['parameters'] / 1e9:.3f} B parameters, {rec['bytes_on_disk_per_model'] / GB:.2f} GB "
                  f"per model on disk", "",
                  f"hidden {rec['config']['hidden_size']}, MLP {rec['config']['intermediate_size']}, "
                  f"{rec['config']['num_attention_heads']} heads / "
                  f"{rec['config']['num_key_value_heads']} KV, "
                  f"vocab {rec['config']['vocab_size']}; one layer {rec['layer_bytes'] / GB:.3f} GB, "
                  f"embeddings + head + norm {rec['nonlayer_bytes'] / GB:.3f} GB; full depth "
                  f"{rec['full_model_bytes'] / GB:.2f} GB per model. "
                  f"Page cache before merges: {rec['cache']}."
                  + _writer_note(rec["pair"]) +
                  f" Run {rec['run']['time']}, symgraph {rec['run']['symgraph_commit']}"
                  + (f", mergekit/torch/transformers {mk}" if mk else "") + ".", "",
                  "| stage | wall s | CPU s | peak RSS GB | in GB | out GB | s / layer | time × mergekit "
                  "| RSS × mergekit | status |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name in STAGES:
            r = s.get(name)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {name} | | | | | | | | | skipped: {r['skipped']} |")
                continue
            status = "ok" if r["ok"] else f"**failed** rc {r['rc']}: {r.get('error') or ''}".replace("|", "/")
            if name.startswith("read") and r.get("read"):
                rd = r["read"]
                status += (f": {rd['bytes'] / GB:.3g} GB in {rd['seconds']:.3g} s = "
                           f"{rd['gb_per_s']:.2f} GB/s (read loop only)")
            lines.append(f"| {name} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_gb']:.2f} | "
                         f"{r['bytes_in'] / GB:.3g} | "
                         f"{_f(r.get('bytes_out') and r['bytes_out'] / GB, '{:.3g}')} | "
                         f"{r['seconds_per_layer']:.2f} | {_f(r.get('time_ratio_vs_mergekit'))} | "
                         f"{_f(r.get('rss_ratio_vs_mergekit'))} | {status} |")
        c = rec.get("checks", {})
        checks = [f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in c.items()
                  if isinstance(v, dict) and "ok" in v]
        checks = [f"input {m_} {'ok' if v['ok'] else 'FAILED'}"
                  for m_, v in c.get("inputs", {}).items()] + checks
        lines += ["", "Checks (" + ("`from_pretrained` + " if c.get("from_pretrained") else "")
                  + "names/shapes/bf16 from headers): " + (", ".join(checks) or "none") + "."]
        cmp_ = c.get("none_vs_mergekit")
        if cmp_ and "symgraph_vs_mergekit" in cmp_:
            sm, se, me = (cmp_[k] for k in ("symgraph_vs_mergekit", "symgraph_vs_exact", "mergekit_vs_exact"))
            lines.append(f"`--align none` vs mergekit over {cmp_['elements'] / 1e6:.1f} M elements: "
                         f"max |diff| {sm['max_abs_diff']:.3g}, {sm['elements_differ']} elements differ, "
                         f"within 1 bf16 ulp: {sm['within_1ulp']}; against exact bf16(0.5A+0.5B): "
                         f"symgraph max |diff| {se['max_abs_diff']:.3g} ({se['elements_differ']} differ), "
                         f"mergekit {me['max_abs_diff']:.3g} ({me['elements_differ']} differ).")
        elif cmp_:
            lines.append(f"`--align none` vs mergekit: FAILED ({cmp_.get('error')}).")
        lines.append("")
    return "\n".join(lines)


def run(shapes, layers=None, work=DEFAULT_WORK, out=str(DEFAULT_OUT), stages=STAGES, timeout=3600.0,
        cache="warm", mergekit_venv=None, load_check_gb=0.5, keep_outputs=False, append=False) -> dict:
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    mergekit_venv = Path(mergekit_venv) if mergekit_venv else work / "mergekit-venv"
    result = {"benchmark": "scale", "machine": machine_info(), "shapes": []}
    out = Path(out)
    if append and out.exists():
        try:
            old = json.loads(out.read_text())
            now = {(s, layers or SHAPES[s]["num_hidden_layers"]) for s in shapes}
            result["shapes"] = [r for r in old.get("shapes", []) if (r["shape"], r["layers"]) not in now]
        except (ValueError, KeyError):
            pass
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for shape in shapes:
        rec = run_shape(shape, layers, work, stages, timeout, cache, mergekit_venv, load_check_gb,
                        keep_outputs)
        rec["machine"] = result["machine"]
        result["shapes"].append(rec)
        _write(result, out)  # after every shape, so a later crash keeps what was measured
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out, json.dumps(result, indent=1)), (out.with_suffix(".md"), markdown(result))):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,1b",
                    help=f"comma-separated, of {', '.join(SHAPES)} (default tiny,1b)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--work", default=DEFAULT_WORK, help=f"checkpoints, outputs, logs, mergekit venv "
                    f"(default {DEFAULT_WORK})")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results; the .md goes next to it")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="comma-separated subset of " + ", ".join(STAGES))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per stage (default 3600)")
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm",
                    help="page-cache state of the inputs before each merge stage (default warm)")
    ap.add_argument("--mergekit-venv", default=None, help="mergekit's venv (default <work>/mergekit-venv)")
    ap.add_argument("--load-check-gb", type=float, default=0.5,
                    help="load outputs with from_pretrained up to this model size (default 0.5 GB)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the merged checkpoints")
    ap.add_argument("--append", action="store_true", help="keep other shapes' entries of an existing --out")
    ap.add_argument("--_read", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--_write", nargs=4, metavar=("DIR", "SHAPE", "LAYERS", "SEED"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._read:
        print(json.dumps(read_all(a._read)))
        return
    if a._write:
        path, shape, layers, seed = a._write
        print(json.dumps(write_checkpoint(path, llama_config(shape, int(layers)), int(seed))))
        return
    shapes = [s for s in a.shapes.split(",") if s]
    stages = [s for s in a.stages.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected one of {', '.join(SHAPES)}")
    for s in stages:
        if s not in STAGES:
            ap.error(f"unknown stage {s!r}; expected some of {', '.join(STAGES)}")
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be >= 1")
    run(shapes, a.layers, a.work, a.out, stages, a.timeout, a.cache, a.mergekit_venv, a.load_check_gb,
        a.keep_outputs, a.append)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings
    warnings.filterwarnings("ignore")
    main()

"""Scale benchmark: ``symgraph merge`` on LLaMA-shaped bf16 checkpoints against mergekit's
linear merge of the same pair, in the same run.

Checkpoints. For each shape (``tiny``: 2 layers, hidden 256; ``155m``: 155.3 M parameters,
768/2816, 12 layers, 12 heads; ``1b``: TinyLlama-1.1B, 2048/5632,
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
* ``symgraph_none`` / ``symgraph_weights``: ``symgraph merge A B --out O --align none|weights``;
  ``symgraph_weights_exact`` adds ``--until exact`` (the sweeps end once no element changes:
  the default before ``gap``), ``symgraph_weights_discrete`` adds ``--until discrete`` (the sweeps end once no discrete
  element changes), ``symgraph_weights_tol`` ``--tol 1e-3``.
* ``symgraph_activations``: ``symgraph merge A B --out O --align activations --data D`` with
  ``D`` :data:`DATA_ROWS` random rows of :data:`DATA_TOKENS` token ids (fixed seed): out of
  core, the two graphs run side by side from the checkpoints, statistics in passes.
* ``symgraph_regmean`` / ``symgraph_fisher`` / ``symgraph_repair``: ``symgraph merge A B --align
  weights`` with ``--method regmean``, ``--method fisher`` or ``--repair`` and ``--data D``: the
  merge engine's statistics (input Grams, squared gradients, REPAIR's channel moments) out of core.
  ``--memory-budget SIZE`` is given to every symgraph stage (the engine's default otherwise).
* ``symgraph_weights_baseline`` (only with ``--baseline REF``): ``symgraph_weights``' command
  run as ``python -m symgraph`` in this repository's tree at ``REF`` (``git archive`` under
  ``--work``), in the same environment: the speed of this commit against an older one in the
  same run, on the same machine (``time_ratio_vs_baseline`` of ``symgraph_weights``).

Before each merge stage the earlier stages' outputs are written back (``os.sync``: a disk that
writes back slower than a merge writes would otherwise charge one stage for another's output)
and the inputs' page-cache state is set by ``--cache``: ``warm`` (default) reads both inputs
through once, ``cold`` drops them (as above). The machine's float32 and bfloat16 matmul rates
are measured before and after the stages (a fresh process, 4096², best of 3): the yardstick of
the seconds on a machine whose speed drifts. GB is 10^9 bytes throughout.

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
from pathlib import Path

# the parts live in benchmarks/scale/, one job a module (make_tensor and measure: re-exported for
# tests/test_bench_scale.py)
from .harness import script
from .provenance import write_beside
from .scale.checkpoints import llama_config, make_tensor, read_all, write_checkpoint  # noqa: F401
from .scale.common import BASELINE, DEFAULT_OUT, DEFAULT_WORK, SHAPES, STAGES, log, measure  # noqa: F401
from .scale.report import markdown
from .scale.stages import baseline_tree, machine_info, run_shape

DEFAULT_STAGES = tuple(s for s in STAGES if s != BASELINE)  # the baseline runs when asked for


def run(shapes, layers=None, work=DEFAULT_WORK, out=str(DEFAULT_OUT), stages=DEFAULT_STAGES, timeout=3600.0,
        cache="warm", mergekit_venv=None, load_check_gb=0.5, keep_outputs=False, append=False,
        memory_budget=None, baseline=None) -> dict:
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
    tree = baseline_tree(work, baseline) if baseline else None
    for shape in shapes:
        rec = run_shape(shape, layers, work, stages, timeout, cache, mergekit_venv, load_check_gb,
                        keep_outputs, memory_budget, tree)
        rec["machine"] = result["machine"]
        result["shapes"].append(rec)
        _write(result, out)  # after every shape, so a later crash keeps what was measured
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def _write(result: dict, out: Path) -> None:
    write_beside(out, result, markdown(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,1b",
                    help=f"comma-separated, of {', '.join(SHAPES)} (default tiny,1b)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--work", default=DEFAULT_WORK, help=f"checkpoints, outputs, logs, mergekit venv "
                    f"(default {DEFAULT_WORK})")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results; the .md goes next to it")
    ap.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                    help="comma-separated subset of " + ", ".join(STAGES))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per stage (default 3600)")
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm",
                    help="page-cache state of the inputs before each merge stage (default warm)")
    ap.add_argument("--mergekit-venv", default=None, help="mergekit's venv (default <work>/mergekit-venv)")
    ap.add_argument("--load-check-gb", type=float, default=0.5,
                    help="load outputs with from_pretrained up to this model size (default 0.5 GB)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the merged checkpoints")
    ap.add_argument("--append", action="store_true", help="keep other shapes' entries of an existing --out")
    ap.add_argument("--memory-budget", default=None, metavar="SIZE",
                    help="the symgraph stages' --memory-budget, e.g. 256MB (default: the engine's)")
    ap.add_argument("--baseline", metavar="REF", default=None,
                    help="the commit whose symgraph_weights_baseline stage runs (that stage needs it)")
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
    if (a.baseline is None) == (BASELINE in stages):
        ap.error(f"--baseline REF and the stage {BASELINE} go together")
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be >= 1")
    if a.memory_budget is not None:
        from symgraph.checkpoints.sharded import parse_size
        from symgraph.errors import InputError
        try:
            parse_size(a.memory_budget)
        except InputError:
            ap.error(f"--memory-budget {a.memory_budget!r}; expected a positive size such as 256MB")
    run(shapes, a.layers, a.work, a.out, stages, a.timeout, a.cache, a.mergekit_venv, a.load_check_gb,
        a.keep_outputs, a.append, a.memory_budget, a.baseline)


if __name__ == "__main__":
    script(main)

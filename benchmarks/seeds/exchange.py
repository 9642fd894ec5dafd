"""What the seeds runner and an author's code, run in its own venv, exchange: a job directory.

The runner writes (:func:`write_job`) ``job.json`` (settings), one directory ``NAME/`` per parent
(``save_pretrained``: the checkpoint format with the parameter names older transformers
versions read), ``batches.safetensors`` (the alignment data, the same batches
our reimplementation is given) and ``reference.safetensors`` (each parent's logits on the first
batch, computed here, which the driver recomputes with the authors' library versions: the
parents crossed over exactly). The driver writes ``out.json`` (its timings, versions and
checks) and ``out.safetensors`` (the merged model's state); :func:`read_output` reads them and
:func:`load_merged` loads a merged state into a model, complete or refused.

:func:`code_tree` is the git tree id of an unpacked author repository, compared with the
pinned commit's tree before any of its code runs; :func:`run_driver` runs a driver in the
author's venv with no byte-code written into their tree and no debugger that could wait on a
terminal.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["JOB", "OUT", "save_state", "load_state", "write_job", "read_output", "load_merged",
           "code_tree", "run_driver", "Failed"]

JOB, OUT = "job.json", "out.json"


class Failed(RuntimeError):
    """An author's code did not produce a model; the message is the exact error it ended with."""


def save_state(path, state: dict) -> None:
    """``state`` (name -> tensor) as safetensors; tied tensors are written as separate copies
    (safetensors refuses shared storage), each with its dtype."""
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))


def load_state(path) -> dict:
    """The tensors of a safetensors file, as written (names, dtypes, shapes)."""
    return load_file(str(path))


def write_job(d, models: dict, batches: dict, reference: dict, settings: dict) -> Path:
    """A job directory ``d`` for a driver: each model of ``models`` (name -> HF model) saved in
    ``NAME/`` (``save_pretrained``, safetensors), ``batches`` and ``reference`` (name -> tensor)
    as safetensors, ``settings`` in ``job.json``. Returns ``d``."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    for name, m in models.items():
        m.save_pretrained(d / name, safe_serialization=True)
    save_state(d / "batches.safetensors", batches)
    save_state(d / "reference.safetensors", reference)
    (d / JOB).write_text(json.dumps({"models": sorted(models), **settings}, indent=1))
    return d


def read_output(d) -> tuple[dict, dict, dict]:
    """``(out.json, out.safetensors, variants)`` of a finished job: each variant ``NAME`` that
    ``out.json`` names is the merged state with the entries of ``variant_NAME.safetensors``
    in place of its own. :class:`Failed` when the driver wrote no output or a variant names an
    entry the state lacks."""
    d = Path(d)
    if not (d / OUT).is_file() or not (d / "out.safetensors").is_file():
        raise Failed(f"the driver wrote no {OUT} and out.safetensors in its job directory")
    info, state = json.loads((d / OUT).read_text()), load_state(d / "out.safetensors")
    variants = {}
    for name in info.get("variants", {}):
        swap = load_state(d / f"variant_{name}.safetensors")
        if set(swap) - set(state):
            raise Failed(f"variant {name} replaces entries the merged state lacks: {sorted(set(swap) - set(state))}")
        variants[name] = {**state, **swap}
    return info, state, variants


def load_merged(template: torch.nn.Module, state: dict, untied=()) -> torch.nn.Module:
    """A model of ``template``'s class and config holding ``state``, written by an author's code
    with their transformers version's parameter names: loaded by this version's
    ``from_pretrained``, which converts a checkpoint's older names, from a temporary directory.
    ``untied``: the merged model gives its decoder a weight of its own (the config's
    ``tie_word_embeddings`` off). Every parameter must come from ``state`` with its shape and
    nothing in ``state`` may go unused; anything else is refused (ValueError naming it), so a
    merge is used whole or not at all."""
    cfg = copy.deepcopy(template.config)
    if untied:
        cfg.tie_word_embeddings = False
    with tempfile.TemporaryDirectory(prefix="seeds-merged-") as tmp:
        cfg.save_pretrained(tmp)
        save_state(Path(tmp) / "model.safetensors", state)
        try:
            model, info = type(template).from_pretrained(
                tmp, trust_remote_code=False, output_loading_info=True, dtype=template.dtype,
                attn_implementation=getattr(template.config, "_attn_implementation", None))
        except RuntimeError as e:  # a shape or conversion it cannot load
            raise ValueError(f"merged state does not fit the model: {e}") from None
    bad = {k: sorted(map(str, v))[:5] for k, v in info.items() if v}
    if bad:
        raise ValueError(f"merged state does not fit the model: {bad}")
    return model.eval()


def code_tree(code_dir) -> str:
    """The git tree id of the files under ``code_dir`` (as ``git write-tree`` of them all),
    equal to a commit's ``HEAD^{tree}`` when the directory is that commit's checkout."""
    with tempfile.TemporaryDirectory(prefix="seeds-tree-") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        git = ["git", f"--git-dir={Path(tmp) / 'git'}", f"--work-tree={code_dir}"]
        subprocess.run(["git", "init", "-q", "--bare", str(Path(tmp) / "git")], check=True)
        subprocess.run([*git, "add", "-A", "-f", "."], cwd=code_dir, env=env, check=True,
                       capture_output=True)
        return subprocess.run([*git, "write-tree"], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()


def run_driver(python, script, code_dir, job_dir, timeout: float) -> str:
    """Run ``python script --code CODE --job JOB`` (the author's venv); returns its stderr.
    No ``.pyc`` is written into their tree, ``breakpoint()`` does nothing and standard input
    is empty (a ``pdb.set_trace()`` in their code quits instead of waiting). A non-zero exit or
    a timeout raises :class:`Failed` with the last line the driver printed."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONBREAKPOINT="0", PYTHONPATH="")
    try:
        res = subprocess.run([str(python), str(script), "--code", str(code_dir), "--job", str(job_dir)],
                             env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"did not finish in {timeout:.0f} s") from None
    except OSError as e:
        raise Failed(f"could not start {python}: {e}") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + res.stdout).strip().splitlines() if ln.strip()]
        raise Failed(lines[-1].strip() if lines else f"exit status {res.returncode}, no output")
    return res.stderr

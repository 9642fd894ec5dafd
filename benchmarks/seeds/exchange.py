"""What the seeds runner and an author's driver, run in its own venv, exchange: a job directory.

The runner writes (:func:`write_job`) ``job.json`` (settings), ``NAME/`` per parent
(``save_pretrained``: parameter names older transformers versions read), ``batches.safetensors``
(the alignment batches our reimplementation is given too) and ``reference.safetensors`` (each
parent's logits on the first batch, which the driver recomputes with the author's versions). The
driver writes ``out.json`` (timings, versions, checks) and ``out.safetensors`` (the merged state).
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

JOB, OUT = "job.json", "out.json"


class Failed(RuntimeError):
    """An author's code did not produce a model; the message is the exact error it ended with."""


def save_state(path, state: dict) -> None:
    """``state`` (name -> tensor) as safetensors, tied tensors as separate copies, each its dtype."""
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))


def load_state(path) -> dict:
    return load_file(str(path))


def write_job(d, models: dict, batches: dict, reference: dict, settings: dict) -> Path:
    """The job directory ``d``: each of ``models`` (name -> HF model) in ``NAME/``, ``batches`` and
    ``reference`` (name -> tensor) as safetensors, ``settings`` in ``job.json``."""
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
    ``out.json`` names is the merged state with ``variant_NAME.safetensors``'s entries in place of
    its own. :class:`Failed` when there is no output or a variant names an entry the state lacks."""
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
    """A model of ``template``'s class and config holding ``state`` (the author's transformers
    version's names, converted by this version's ``from_pretrained``); ``untied``: the decoder has a
    weight of its own. Every parameter must come from ``state`` with its shape and nothing in it may
    go unused, else ValueError: a merge is used whole or not at all."""
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
    """The git tree id of the files under ``code_dir``: a commit's ``HEAD^{tree}`` when the
    directory is that commit's checkout (checked before any of the author's code runs)."""
    with tempfile.TemporaryDirectory(prefix="seeds-tree-") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        git = ["git", f"--git-dir={Path(tmp) / 'git'}", f"--work-tree={code_dir}"]
        subprocess.run(["git", "init", "-q", "--bare", str(Path(tmp) / "git")], check=True)
        subprocess.run([*git, "add", "-A", "-f", "."], cwd=code_dir, env=env, check=True, capture_output=True)
        return subprocess.run([*git, "write-tree"], env=env, check=True, capture_output=True, text=True).stdout.strip()


def run_driver(python, script, code_dir, job_dir, timeout: float) -> str:
    """Run ``python script --code CODE --job JOB`` (the author's venv); returns its stderr. No
    ``.pyc`` is written into their tree, ``breakpoint()`` does nothing and standard input is empty
    (a ``pdb.set_trace()`` quits). A non-zero exit or a timeout: :class:`Failed`, with the last line
    the driver printed."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONBREAKPOINT="0", PYTHONPATH="")
    try:
        res = subprocess.run([str(python), str(script), "--code", str(code_dir), "--job", str(job_dir)],
                             env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"did not finish in {timeout:.0f} s") from None
    except OSError as e:
        raise Failed(f"could not start {python}: {e}") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + res.stdout).strip().splitlines() if ln.strip()]
        raise Failed(lines[-1].strip() if lines else f"exit status {res.returncode}, no output")
    return res.stderr

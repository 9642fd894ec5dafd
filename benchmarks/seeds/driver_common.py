"""What both drivers share. Runs in an author's venv: the standard library, torch, safetensors
and that venv's transformers only (nothing of symgraph or the benchmarks).

A driver is started as ``PYTHON drive_NAME.py --code DIR --job DIR``: it reads the job
(:mod:`benchmarks.seeds.exchange` wrote it), rebuilds the parents with the author's pinned
transformers, checks their logits against the reference computed by the runner, calls the
author's code and writes ``out.json`` and ``out.safetensors``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: Largest |logit difference| between the runner's and the driver's parents that still counts
#: as the same model (float32; attention kernels differ between library versions).
LOGITS_TOL = 1e-3


def arguments(doc: str):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--code", required=True, help="the author's repository, unpacked at its pinned commit")
    ap.add_argument("--job", required=True, help="the job directory the runner wrote")
    a = ap.parse_args()
    return Path(a.code).resolve(), Path(a.job).resolve()


def job(job_dir: Path) -> dict:
    return json.loads((job_dir / "job.json").read_text())


def parent(job_dir: Path, name: str, model_cls, config_cls):
    """Parent ``name`` rebuilt with this venv's transformers from its saved config and weights
    (no code from the directory runs): every parameter must be given (a tied one once; buffers
    this version recomputes may be absent)."""
    cfg = config_cls.from_dict(json.loads((job_dir / name / "config.json").read_text()))
    model = model_cls(cfg).eval()
    state = load_file(str(job_dir / name / "model.safetensors"))
    res = model.load_state_dict(state, strict=False)
    params = {k for k, _ in model.named_parameters()}
    missing = sorted(set(res.missing_keys) & params)
    if missing:
        raise SystemExit(f"parent {name}: parameters not in the exchanged weights: {missing[:5]}")
    return model


def check_logits(job_dir: Path, models: dict, call) -> dict:
    """``{name: max |logits - reference|}`` on the first exchanged batch; exits when one is
    over :data:`LOGITS_TOL` (the parents did not cross over exactly)."""
    ref = load_file(str(job_dir / "reference.safetensors"))
    out = {}
    with torch.no_grad():
        for name, m in models.items():
            out[name] = float((call(m) - ref[name]).abs().max())
    bad = {k: v for k, v in out.items() if not v <= LOGITS_TOL}
    if bad:
        raise SystemExit(f"parents differ from the runner's after the exchange: max |logit diff| {bad}")
    return out


def write(job_dir: Path, state: dict, info: dict) -> None:
    """The merged state and ``out.json`` (with this venv's versions); ``out.json`` last, so a
    job with it is complete."""
    import transformers
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(job_dir / "out.safetensors"))
    info = {**info, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    (job_dir / "out.json").write_text(json.dumps(info, indent=1))


def save_variant(job_dir: Path, name: str, entries: dict) -> None:
    """``variant_NAME.safetensors``: entries that replace the merged state's in a second row."""
    save_file({k: v.detach().contiguous().clone() for k, v in entries.items()},
              str(job_dir / f"variant_{name}.safetensors"))


class Clock:
    def __init__(self):
        self.t = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t


def on_path(code: Path, *sub: str) -> None:
    """The author's directories first on ``sys.path``, as their own scripts put them."""
    for s in reversed(("",) + sub):
        sys.path.insert(0, str(code / s) if s else str(code))

"""What the drivers share. Runs in an author's venv: the standard library, torch, safetensors and
that venv's transformers only. A driver (``PYTHON drive_NAME.py --code DIR --job DIR``) reads the
job :mod:`benchmarks.seeds.exchange` wrote, rebuilds the parents with the author's pinned
transformers, checks their logits against the runner's, calls the author's code and writes
``out.json`` and ``out.safetensors``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: Largest |logit difference| between the runner's and the driver's parents that still counts
#: as the same model (float32; attention kernels differ between library versions).
LOGITS_TOL = 1e-3


def arguments(doc: str):
    """``(code, job directory, job.json)`` from the command line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--code", required=True, help="the author's repository, unpacked at its pinned commit")
    ap.add_argument("--job", required=True, help="the job directory the runner wrote")
    a = ap.parse_args()
    job_dir = Path(a.job).resolve()
    return Path(a.code).resolve(), job_dir, json.loads((job_dir / "job.json").read_text())


def parents(job_dir: Path, model_cls, config_cls) -> tuple:
    """Parents ``a`` and ``b`` rebuilt with this venv's transformers from their saved config and
    weights (no code from the directory runs): every parameter must be given (a tied one once;
    buffers this version recomputes may be absent)."""
    out = []
    for name in ("a", "b"):
        model = model_cls(config_cls.from_dict(json.loads((job_dir / name / "config.json").read_text()))).eval()
        res = model.load_state_dict(load_file(str(job_dir / name / "model.safetensors")), strict=False)
        missing = sorted(set(res.missing_keys) & {k for k, _ in model.named_parameters()})
        if missing:
            raise SystemExit(f"parent {name}: parameters not in the exchanged weights: {missing[:5]}")
        out.append(model)
    return tuple(out)


def check_logits(job_dir: Path, models: dict, call) -> dict:
    """``{name: max |logits - reference|}`` on the first exchanged batch; exits when one is
    over :data:`LOGITS_TOL` (the parents did not cross over exactly)."""
    ref = load_file(str(job_dir / "reference.safetensors"))
    with torch.no_grad():
        out = {name: float((call(m) - ref[name]).abs().max()) for name, m in models.items()}
    bad = {k: v for k, v in out.items() if not v <= LOGITS_TOL}
    if bad:
        raise SystemExit(f"parents differ from the runner's after the exchange: max |logit diff| {bad}")
    return out


def _save(path: Path, state: dict) -> None:
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))


def write(job_dir: Path, state: dict, info: dict) -> None:
    """The merged state and ``out.json`` (with this venv's versions); ``out.json`` last, so a
    job with it is complete."""
    import transformers
    _save(job_dir / "out.safetensors", state)
    info = {**info, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    (job_dir / "out.json").write_text(json.dumps(info, indent=1))


def save_variant(job_dir: Path, name: str, entries: dict) -> None:
    """``variant_NAME.safetensors``: entries that replace the merged state's in a second row."""
    _save(job_dir / f"variant_{name}.safetensors", entries)


def on_path(code: Path, *sub: str) -> None:
    """The author's directories first on ``sys.path``, as their own scripts put them."""
    for s in reversed(("",) + sub):
        sys.path.insert(0, str(code / s) if s else str(code))

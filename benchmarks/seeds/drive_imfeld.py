"""Imfeld et al. (ICLR 2024), "Transformer Fusion with Optimal Transport": their code fuses the
suite's ViT pair. Runs in their venv (``PYTHON drive_imfeld.py --code DIR --job DIR``).

What their ``main.py`` does for ``python main.py fuse_hf_vit_cifar10.yaml``, on our parents and
images: their ``experiments/fuse_hf_vit_cifar10.yaml`` as published (activation-based OT,
Sinkhorn 0.08, residual policy "mean", Q/K "separate", ...) except ``fusion.acts.num_samples``,
the number of alignment images in the job (theirs: 200 CIFAR-10 validation images). ``model_1``,
the anchor (their ``anker``), is our A; ``model_0`` our B. Images one at a time (their
``get_dataloader``: ``batch_size=1``), activations by their ``get_activations``, the fusion by
their ``hf_vit_fusion`` with ``alpha = 1 / num_models``; the fused nested dictionary turned into
parameters by the walk of their ``get_model``.

Run-time shim (their files are not edited): ``os.get_terminal_size`` answers 80x24 when the
output is not a terminal (their ``fc_fusion`` always computes a debug histogram that asks the
terminal for its width).
"""
from __future__ import annotations

import copy
import logging
import os
import random
import time

import numpy as np
import torch
from safetensors.torch import load_file

import driver_common as dc

CONFIG = "experiments/fuse_hf_vit_cifar10.yaml"
_terminal_size = os.get_terminal_size


def _terminal_or_default(*args):
    try:
        return _terminal_size(*args)
    except OSError:
        return os.terminal_size((80, 24))


def flat(model, nested: dict) -> dict:
    """Their ``get_model`` walk: every parameter name of ``model`` looked up in ``nested``."""
    state = {}
    for name, _ in model.named_parameters():
        node = nested
        for w in name.split("."):
            node = node[w]
        state[name] = node.detach().clone()
    return state


def main() -> None:
    import yaml
    from transformers import ViTConfig, ViTForImageClassification
    code, job_dir, job = dc.arguments(__doc__)
    dc.on_path(code, "otfusion")
    os.get_terminal_size = _terminal_or_default
    from otfusion.hf_vit_fusion import hf_vit_fusion
    from otfusion.utils import get_activations, model_to_dict
    args = yaml.safe_load((code / CONFIG).read_text())
    batches = load_file(str(job_dir / "batches.safetensors"))
    x, y = batches["pixel_values"], batches["labels"]
    args["fusion"]["acts"]["num_samples"] = int(x.shape[0])
    seed = args["fusion"]["acts"]["seed"]  # their main.py's seeding
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    a, b = dc.parents(job_dir, ViTForImageClassification, ViTConfig)
    diffs = dc.check_logits(job_dir, {"a": a, "b": b}, lambda m: m(x[: job["reference_rows"]]).logits)
    t = time.perf_counter()
    models = [copy.deepcopy(b), copy.deepcopy(a)]  # model_0, model_1 (the anchor)
    weights = {f"model_{i}": model_to_dict(m) for i, m in enumerate(models)}
    loader = [{"pixel_values": x[i:i + 1], "labels": y[i:i + 1]} for i in range(x.shape[0])]
    with torch.no_grad():
        acts = get_activations(args=args, models=models, dataloader=loader, LOGGING_LEVEL=logging.WARNING,
                               device=torch.device("cpu"))
        fused = hf_vit_fusion(args=args, weights={"model_1": weights["model_1"], "model_0": weights["model_0"]},
                              acts={"model_1": acts["model_1"], "model_0": acts["model_0"]},
                              alpha=1 / args["fusion"]["num_models"], device=torch.device("cpu"),
                              LOGGING_LEVEL=logging.WARNING)
    seconds = time.perf_counter() - t
    state = flat(a, fused)
    dc.write(job_dir, state, {"seconds": seconds, "config": CONFIG, "fusion": args["fusion"],
                              "images": int(x.shape[0]), "parent_logit_diff": diffs,
                              "shims": ["os.get_terminal_size: 80x24 without a terminal"]})


if __name__ == "__main__":
    main()

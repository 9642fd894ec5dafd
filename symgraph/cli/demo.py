"""``symgraph demo``: two tiny byte-level GPT-2s trained from different seeds on the prose in
``pydoc_data.topics`` (shipped with Python, no download), merged without alignment, with
weight matching and with activation matching; prints held-out loss at λ=0.5 and the loss
barrier of each, and plots the interpolation curves to ``barrier.png``.

Trained models are cached under ``$SYMGRAPH_CACHE`` (default ``~/.cache/symgraph``).
"""
from __future__ import annotations

import os
import sys
from typing import Annotated

import torch
from pydantic import Field, StrictFloat, StrictInt

from ..core.schema import Number
from ..core.progress import quiet

__all__ = ["run_demo", "trained_models", "make_model", "corpus", "batches", "heldout_loss_fn",
           "cache_dir"]

CACHE_VERSION = "demo-gpt2-char-v1"
SEQ = 64
BATCH = 32
SEEDS = (0, 1)
DEFAULT_SECONDS = 80.0
#: The training budget: finite, above 0, at most a day.
SECONDS = Number(Annotated[StrictFloat | StrictInt, Field(gt=0, le=86400, allow_inf_nan=False)],
                 "a training budget in seconds, above 0 and at most 86400 (a day)")
LR = 3e-3
# symgraph.testing.models.build keywords of the demo's GPT-2 (HF's default use_cache, no pad token)
MODEL: dict = dict(vocab=256, hidden=64, layers=2, heads=4, mlp=None, positions=SEQ, use_cache=None,
             pad_token_id=None)


def cache_dir() -> str:
    return os.path.join(os.path.expanduser(os.environ.get("SYMGRAPH_CACHE", "~/.cache/symgraph")),
                        CACHE_VERSION)


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level train / held-out token streams (90% / 10%) from ``pydoc_data.topics``."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def make_model(seed: int):
    """The demo's byte-level GPT-2 (byte vocabulary, 2 layers of width 64), seeded, built by
    :mod:`symgraph.testing.models`."""
    import transformers

    from ..testing import models
    transformers.logging.set_verbosity_error()
    return models.build("gpt2", seed, **MODEL)


def batches(stream: torch.Tensor, n: int, rows: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - SEQ, (n, rows), generator=g)
    return [torch.stack([stream[s:s + SEQ] for s in row.tolist()]) for row in starts]


def trained_models(seconds: float | None = None, retrain: bool = False):
    """The two cached models, training (and caching) them first if needed."""
    from tqdm import tqdm

    from ..checkpoints.specs import load_local, save_atomic
    seconds = DEFAULT_SECONDS if seconds is None else float(SECONDS.check(seconds, "seconds="))
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    train_stream, _ = corpus()
    models = []
    todo = [s for s in SEEDS if retrain or not os.path.isfile(os.path.join(root, f"seed{s}", "model.safetensors"))]
    bar = tqdm(total=round(seconds * len(todo) / len(SEEDS)), desc="training", unit="s", file=sys.stderr,
               leave=False, disable=not todo or quiet(), bar_format="{desc}: {n:.0f}/{total}s |{bar}| {postfix}")
    try:
        for s in SEEDS:
            path = os.path.join(root, f"seed{s}")
            if s in todo:
                base = bar.n
                m = _train_with_bar(s, train_stream, seconds / len(SEEDS), bar, base)
                save_atomic(m, path, force=True)
            models.append(load_local(path))
    finally:
        bar.close()
    return models


def _train_with_bar(seed, stream, seconds, bar, base):
    """Train the seed's model for ``seconds`` on one thread (the model is tiny: thread overhead
    dominates), showing progress on ``bar`` from ``base`` seconds on."""
    from ..testing import models
    model = make_model(seed)
    g = torch.Generator().manual_seed(1000 + seed)

    def sample():
        starts = torch.randint(0, len(stream) - SEQ, (BATCH,), generator=g)
        x = torch.stack([stream[s:s + SEQ] for s in starts.tolist()])
        return {"input_ids": x, "labels": x}

    def progress(step, loss, elapsed):
        if step % 10 == 0:
            bar.set_postfix_str(f"seed {seed} step {step} loss {loss:.3f}")
            bar.n = base + min(elapsed, seconds)
            bar.refresh()

    models.train(model, sample, seconds=seconds, lr=LR, weight_decay=0.01, decay_vectors=True,
                 grad_clip=1.0, progress=progress, threads=1)
    return model


def heldout_loss_fn(heldout_stream, n_batches: int = 4, rows: int = 16):
    evals = batches(heldout_stream, n_batches, rows, seed=123)

    @torch.no_grad()
    def loss_fn(model):
        model.eval()
        return float(sum(model(input_ids=x, labels=x).loss.item() for x in evals) / len(evals))
    return loss_fn


def run_demo(out: str = "symgraph-demo", seconds: float | None = None, force_retrain: bool = False,
             n_lambdas: int = 21, force: bool = False):
    """Train (or load cached) models, merge three ways, print a table, write ``barrier.png``
    into ``out``: a new directory, or (with ``force``) a previous output of symgraph's, vetted
    before any work and written atomically like every output."""
    import numpy as np
    from tqdm import tqdm

    import symgraph
    from ..checkpoints.outdir import check_out, save_atomic
    if seconds is not None:
        SECONDS.check(seconds, "seconds=")
    out = check_out(out, force=force)
    a, b = trained_models(seconds, retrain=force_retrain)
    train_stream, heldout = corpus()
    loss_fn = heldout_loss_fn(heldout)
    data = [{"input_ids": x} for x in batches(train_stream, 8, 8, seed=7)]
    lambdas = np.linspace(0, 1, n_lambdas)
    rows, curves = [], {}
    for name in tqdm(("none", "weights", "activations"), desc="merging", file=sys.stderr, leave=False,
                     disable=quiet()):
        align = None if name == "none" else name
        res = symgraph.merge([a, b], align=align, data=data, method="average")
        merged, als = res.model, res.alignments
        b_in_a = b if als[1] is None else als[1].apply(b)
        curve = symgraph.interpolate(a, b_in_a, lambdas=lambdas, loss_fn=loss_fn)
        curves[name] = curve
        rows.append((name, loss_fn(merged), symgraph.loss_barrier(curve), curve[-1][1], curve[0][1]))
    print(f"held-out loss (nats/byte) of two byte-level GPT-2s (seeds {SEEDS[0]}, {SEEDS[1]}): "
          f"A = {rows[0][3]:.3f}, B = {rows[0][4]:.3f}")
    print(f"{'align':<12} {'loss @ λ=0.5':>13} {'barrier':>9}")
    print("-" * 36)
    for name, l05, bar, _, _ in rows:
        print(f"{name:<12} {l05:>13.3f} {bar:>9.3f}")
    save_atomic(lambda d: _plot(curves, os.path.join(d, "barrier.png")), out, force=force,
                 meta={"mode": "demo", "rows": rows}, record="symgraph_demo.json")
    print(f"wrote {os.path.join(out, 'barrier.png')}")
    return rows


def _plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        lam, loss = zip(*curve)
        ax.plot(lam, loss, marker="o", ms=3, label=f"align={name}")
    ax.set_xlabel("λ  (λ·θ_A + (1−λ)·θ_B)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("Linear interpolation between two byte-level GPT-2s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)  # into save_atomic's private temporary directory
    plt.close(fig)

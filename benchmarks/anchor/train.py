"""Train one parent of the Theus et al. (2025) Tiny Shakespeare protocol, resumably:
``python -m benchmarks.anchor.train --corpus F --tokenizer DIR --seed N``.

The authors' ``train.py`` + ``run_train.sh`` (HF Trainer, transformers 4.50.1) with the Trainer's
defaults made explicit: AdamW (betas 0.9/0.999, eps 1e-8, lr 3e-4, weight decay 0.01 except on
biases and LayerNorm parameters), gradient-norm clipping at 1.0, cosine schedule over
``100 * steps_per_epoch`` steps with ``ceil(0.05 * total)`` warm-up steps, batch 32 (an epoch's
last partial batch kept), validation every 50 steps, early stopping after 5 evaluations without a
strict improvement, the best-validation model kept and scored once on test. float32 as theirs (on
CUDA with TF32 off); ``--precision bf16``: bf16 autocast, a variant. ``--seed`` seeds the
initialisation; the data order and the dropout masks come from a data seed that is the same for
every parent (``--data-seed``, 42: their Trainer's ``TrainingArguments.seed`` default). Each
(re)start's device, precision and versions go into ``train_log.json``. The two parents are
independent processes sharing the cache (``benchmarks/anchor/device.sh`` trains both at once):
``tokens-<hash>.pt``, ``parent-seed{N}.ckpt.pt`` (resume checkpoint, rewritten atomically at every
evaluation) and ``parent-seed{N}/`` (best-validation model, ``save_pretrained``, ``train_log.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from .data import (BLOCK_SIZE, AnchorError, batches, config, default_cache, lm_loss, load_splits, sequences,
                   steps_per_epoch, test_loss)

DATA_SEED = 42  # HF TrainingArguments.seed default: the authors' data order and dropout seed
PRECISIONS = ("float32", "bf16")  # float32: the authors' protocol; bf16: autocast, a variant
#: ``--size small``: the recipe on parents a loaded 2-core CPU trains in minutes: width 64, 2
#: layers, 4 heads, 64-token sequences, batch 8, a schedule of 250 steps (lr 1e-3, the schedule's
#: length in place of the paper's 100 epochs)
SIZES = {"paper": {"config": {}, "train": {}},
         "small": {"config": dict(n_embd=64, n_layer=2, n_head=4, n_inner=256),
                   "train": dict(block_size=64, batch_size=8, schedule_steps=250, lr=1e-3)}}


def parent_dir(cache, seed: int) -> Path:
    """Directory of the best-validation model of parent ``seed`` (``save_pretrained`` format)."""
    return Path(cache) / f"parent-seed{seed}"


def checkpoint_path(cache, seed: int) -> Path:
    return Path(cache) / f"parent-seed{seed}.ckpt.pt"


def load_parent(cache, seed: int):
    """The trained best-validation parent ``seed`` as a ``GPT2LMHeadModel`` in eval mode."""
    from transformers import GPT2LMHeadModel
    d = parent_dir(cache, seed)
    if not (d / "config.json").is_file():
        raise AnchorError(f"no trained parent at {d}")
    return GPT2LMHeadModel.from_pretrained(str(d)).eval()


def read_log(cache, seed: int) -> dict | None:
    """``train_log.json`` of parent ``seed``, or None."""
    p = parent_dir(cache, seed) / "train_log.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _atomic(path: Path, obj: dict, save: Callable = lambda obj, p: p.write_text(json.dumps(obj, indent=1))) -> None:
    """``save(obj, tmp)`` into a sibling of ``path`` renamed into place (default: JSON)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save(obj, tmp)
    os.replace(tmp, path)


def _save_best(model, out: Path, log: dict) -> None:
    """Replace ``out`` by a fresh ``save_pretrained`` directory (written aside, then renamed)."""
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    # safetensors reads host memory
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if model.device.type != "cpu" else None
    model.save_pretrained(str(tmp), state_dict=state)
    _atomic(tmp / "train_log.json", log)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_log(out: Path, log: dict) -> None:
    if out.is_dir():
        _atomic(out / "train_log.json", log)


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups as the HF Trainer: no decay for biases and LayerNorm parameters."""
    decay, no_decay = [], []
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.requires_grad:
                (no_decay if isinstance(mod, torch.nn.LayerNorm) or "bias" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(corpus, tokenizer_dir, seed: int, cache=None, threads: int | None = None, max_steps: int | None = None,
          data_seed: int = DATA_SEED, config_overrides: dict | None = None, block_size: int = BLOCK_SIZE,
          batch_size: int = 32, epochs: int = 100, lr: float = 3e-4, weight_decay: float = 0.01,
          warmup_ratio: float = 0.05, max_grad_norm: float = 1.0, eval_every: int = 50, patience: int = 5,
          bf16: bool = False, log_every: int = 5, echo: Callable[[str], None] | None = None,
          device: str | torch.device = "cpu", retrain: bool = False, schedule_steps: int | None = None) -> dict:
    """Train (or resume, or return at once if finished) parent ``seed``; returns its train log.
    ``max_steps`` stops after that step with a checkpoint (not ``done``: the schedule is the full
    one); ``schedule_steps``: the schedule's length in steps instead of ``epochs`` epochs (training
    ends there, done). Other settings than an existing checkpoint's are an error, and so is another
    precision than a finished parent's (``retrain``: start over)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    say = echo or (lambda m: print(m, flush=True))
    cache = Path(cache) if cache is not None else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    prev = _finished(cache, seed, bf16, retrain)
    if prev is not None:
        say(f"seed {seed}: already trained (test loss {prev.get('final_test_loss')}), {parent_dir(cache, seed)}")
        return prev
    if threads:
        torch.set_num_threads(int(threads))
    dev = torch.device(device)
    splits = load_splits(corpus, tokenizer_dir, cache=cache)
    seqs = {k: sequences(splits[k], block_size).to(dev) for k in ("train", "validation", "test")}
    if min(s.shape[0] for s in seqs.values()) == 0:
        raise AnchorError(f"a split has no complete {block_size}-token sequence")
    cfg = config(block_size=block_size, **(config_overrides or {}))
    protocol = dict(
        seed=seed, data_seed=data_seed, config=cfg.to_diff_dict(), block_size=block_size,
        batch_size=batch_size, epochs=epochs, lr=lr, weight_decay=weight_decay,
        warmup_ratio=warmup_ratio, max_grad_norm=max_grad_norm, eval_every=eval_every,
        patience=patience, bf16=bf16, **({"schedule_steps": schedule_steps} if schedule_steps else {}),
        n_train=int(seqs["train"].shape[0]), n_val=int(seqs["validation"].shape[0]), n_test=int(seqs["test"].shape[0]),
    )
    protocol["config"].pop("transformers_version", None)
    run = _Run(cache, cfg, protocol, dev, say, seqs, 8 if dev.type == "cpu" else 64)  # sequences per eval batch
    return run.finish(run.loop(max_steps, log_every))


def _finished(cache: Path, seed: int, bf16: bool, retrain: bool) -> dict | None:
    """The train log of parent ``seed`` when it is done (in the precision asked for: else an
    error), else None; ``retrain`` removes its checkpoint and model first, and a model left aside
    by a run stopped between :func:`_save_best`'s two renames is put back."""
    out, old = parent_dir(cache, seed), parent_dir(cache, seed).with_name(f"parent-seed{seed}.old")
    if retrain:
        if out.exists():
            shutil.rmtree(out)
        checkpoint_path(cache, seed).unlink(missing_ok=True)
    if not out.exists() and old.exists():
        os.replace(old, out)
    prev = read_log(cache, seed)
    if prev is None or not prev.get("done"):
        return None
    was = bool(prev.get("protocol", {}).get("bf16", False))
    if was != bool(bf16):
        raise AnchorError(f"parent seed {seed} in {cache} was trained in {PRECISIONS[was]}, not "
                          f"{PRECISIONS[bool(bf16)]}: use another cache, or retrain it (--retrain)")
    return prev


class _Run:
    """One parent's training under ``protocol``: the model (seeded by ``protocol["seed"]``), AdamW
    and the cosine schedule, the loop's state ``st`` and the train ``log``, resumed from the
    checkpoint when there is one; :meth:`loop` trains, :meth:`finish` scores the best model."""

    def __init__(self, cache: Path, cfg, protocol: dict, dev: torch.device, say: Callable[[str], None],
                 seqs: dict, eval_bs: int):
        from transformers import GPT2LMHeadModel, get_cosine_schedule_with_warmup
        p, seed = protocol, protocol["seed"]
        self.protocol, self.dev, self.say, self.seqs, self.eval_bs = protocol, dev, say, seqs, eval_bs
        self.out, self.ckpt_path = parent_dir(cache, seed), checkpoint_path(cache, seed)
        self.spe = steps_per_epoch(p["n_train"], p["batch_size"])
        self.total = p.get("schedule_steps") or p["epochs"] * self.spe
        warmup = math.ceil(p["warmup_ratio"] * self.total)
        env = precision_env(dev, p["bf16"])
        torch.manual_seed(seed)
        self.model = GPT2LMHeadModel(cfg).to(dev)  # initialised on the CPU: the same parent on every device
        self.model.config.use_cache = False  # after ``protocol``: whole sequences, no key/value cache to build
        self.model.train()
        self.opt = torch.optim.AdamW(param_groups(self.model, p["weight_decay"]), lr=p["lr"], betas=(0.9, 0.999),
                                     eps=1e-8)
        self.sched = get_cosine_schedule_with_warmup(self.opt, warmup, self.total)
        torch.manual_seed(p["data_seed"])  # the dropout stream (global RNG, CUDA's too), same for every parent
        self.st = dict(step=0, epoch=0, batch=0, best_val=None, best_step=None, bad_evals=0, done=False)
        self.log = dict(
            seed=seed, data_seed=p["data_seed"], protocol=p, steps_per_epoch=self.spe, total_steps=self.total,
            warmup_steps=warmup, n_params=sum(x.numel() for x in self.model.parameters()), train_loss=[],
            step_seconds=[], evals=[], best_step=None, best_val_loss=None, final_test_loss=None,
            stop_reason=None, done=False, wall_seconds=0.0)
        if self.ckpt_path.is_file():
            self._resume()
        else:
            say(f"seed {seed}: {self.log['n_params']} params, {p['n_train']}/{p['n_val']}/{p['n_test']} "
                f"train/val/test sequences of {p['block_size']}, {self.spe} steps/epoch, {self.total} steps max, "
                f"{warmup} warm-up")
        self.log.update(device=env["device"], precision=env["precision"])
        attn = getattr(self.model.config, "_attn_implementation", None)  # sdpa, as their Trainer's default
        self.log["runs"] = self.log.get("runs", []) + [dict(env, start_step=self.st["step"], attn_implementation=attn)]

    def _resume(self) -> None:
        ck = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
        if ck["protocol"] != self.protocol:
            raise AnchorError(f"checkpoint {self.ckpt_path} was made with other settings; remove it to restart")
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["rng"])
        if self.dev.type == "cuda" and ck.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(ck["rng_cuda"], self.dev)
        self.st, self.log = ck["state"], ck["log"]
        self.say(f"seed {self.protocol['seed']}: resumed at step {self.st['step']} (epoch {self.st['epoch']}, "
                 f"batch {self.st['batch']})")

    def checkpoint(self) -> None:
        """The resume checkpoint, host copies: a checkpoint resumes on any device."""
        host = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
        rng_cuda = torch.cuda.get_rng_state(self.dev) if self.dev.type == "cuda" else None
        _atomic(self.ckpt_path, dict(
            protocol=self.protocol, model=tree_map(host, self.model.state_dict()),
            optimizer=tree_map(host, self.opt.state_dict()), scheduler=self.sched.state_dict(),
            rng=torch.get_rng_state(), rng_cuda=rng_cuda, state=self.st, log=self.log), torch.save)

    def step(self, xb: torch.Tensor) -> tuple[float, float]:
        """One optimizer step on the batch ``xb``, logged; ``(loss, seconds)``."""
        p, st, log = self.protocol, self.st, self.log
        t0 = time.perf_counter()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16) if p["bf16"] else contextlib.nullcontext():
            logits = self.model(input_ids=xb).logits
        loss = lm_loss(logits, xb)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([x for x in self.model.parameters() if x.requires_grad], p["max_grad_norm"])
        self.opt.step()
        self.sched.step()
        dt = time.perf_counter() - t0
        st["step"] += 1
        st["batch"] += 1
        lv = loss.item()
        log["train_loss"].append(round(lv, 6))
        log["step_seconds"].append(round(dt, 4))
        log["wall_seconds"] += dt
        return lv, dt

    def evaluate(self, window: list) -> bool:
        """Validation loss at this step: the best model saved when it improves strictly, the log
        written; said with the train loss of ``window``'s steps. True when patience runs out."""
        p, st, log, step = self.protocol, self.st, self.log, self.st["step"]
        t1 = time.perf_counter()
        val = test_loss(self.model, self.seqs["validation"], batch_size=self.eval_bs)
        ev_s = time.perf_counter() - t1
        log["wall_seconds"] += ev_s
        best = st["best_val"] is None or val < st["best_val"]
        log["evals"].append(dict(step=step, epoch=round(step / self.spe, 3), val_loss=round(val, 6),
                                 best=best, eval_seconds=round(ev_s, 2)))
        if best:
            st.update(best_val=val, best_step=step, bad_evals=0)
            log.update(best_step=step, best_val_loss=val)
            _save_best(self.model, self.out, log)
        else:
            st["bad_evals"] += 1
            _write_log(self.out, log)
        tl = sum(w[0] for w in window) / max(len(window), 1)
        tag = " *best*" if best else f" (no gain {st['bad_evals']}/{p['patience']})"
        self.say(f"step {step} ep {step / self.spe:.2f} train {tl:.4f} val {val:.4f}{tag} "
                 f"lr {self.sched.get_last_lr()[0]:.2e} {window[-1][1]:.2f} s/step eval {ev_s:.1f} s")
        return st["bad_evals"] >= p["patience"]

    def loop(self, max_steps: int | None, log_every: int) -> str | None:
        """Epochs of steps from where the state stands, evaluated every ``eval_every`` steps (and
        checkpointed there) until the epochs end (None), early stopping (``"early_stop"``), the
        schedule's end (``"schedule"``) or ``max_steps`` (``"max_steps"``, checkpointed)."""
        p, st = self.protocol, self.st
        window: list[tuple[float, float]] = []
        stop = None
        while st["epoch"] < p["epochs"] and stop is None:
            for xb in batches(self.seqs["train"], p["batch_size"], seed=p["data_seed"], epoch=st["epoch"],
                              start=st["batch"]):
                window.append(self.step(xb))
                step = st["step"]
                if step % p["eval_every"] == 0:
                    stop = "early_stop" if self.evaluate(window) else None
                    window = []
                elif step % log_every == 0 or step <= 3:
                    tl, ts = (sum(w[i] for w in window) / len(window) for i in (0, 1))
                    self.say(f"step {step} ep {step / self.spe:.2f} train {tl:.4f} "
                             f"lr {self.sched.get_last_lr()[0]:.2e} {ts:.2f} s/step")
                    if step > 3:
                        window = []
                if stop is None and max_steps is not None and step >= max_steps:
                    stop = "max_steps"
                if stop is None and p.get("schedule_steps") and step >= self.total:
                    stop = "schedule"
                if (step % p["eval_every"] == 0 or stop is not None) and stop in (None, "max_steps"):
                    self.checkpoint()
                if stop is not None:
                    break
            else:
                st["epoch"] += 1
                st["batch"] = 0
        return stop

    def finish(self, stop: str | None) -> dict:
        """The train log once :meth:`loop` has stopped for ``stop``: unless at ``max_steps``, the
        best model (the last one when never evaluated) scored on test, the run done."""
        from transformers import GPT2LMHeadModel
        st, log, seed = self.st, self.log, self.protocol["seed"]
        if stop == "max_steps":
            self.say(f"seed {seed}: stopped at step {st['step']} (--max-steps), checkpoint {self.ckpt_path}")
            return log
        log["stop_reason"] = stop or "epochs"
        if st["best_step"] is None:  # never evaluated: keep the final model as the parent
            val = test_loss(self.model, self.seqs["validation"], batch_size=self.eval_bs)
            st.update(best_val=val, best_step=st["step"])
            log.update(best_step=st["step"], best_val_loss=val)
            _save_best(self.model, self.out, log)
        best_model = GPT2LMHeadModel.from_pretrained(str(self.out)).to(self.dev)
        log["final_test_loss"] = test_loss(best_model, self.seqs["test"], batch_size=self.eval_bs)
        log["done"] = st["done"] = True
        _write_log(self.out, log)
        self.checkpoint()
        self.say(f"seed {seed}: done ({log['stop_reason']}) at step {st['step']}, best step {log['best_step']} "
                 f"val {log['best_val_loss']:.4f} test {log['final_test_loss']:.4f} -> {self.out}")
        return log


def precision_env(dev: torch.device, bf16: bool) -> dict:
    """Set true float32 matrix products on ``dev`` (CUDA: TF32 off, the legacy switches); what a
    run records (a switch torch refuses is recorded, not fatal)."""
    import transformers
    out: dict = {}
    cuda = dev.type == "cuda"
    try:
        torch.set_float32_matmul_precision("highest")
        if cuda:
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        out.update(float32_matmul_precision=torch.get_float32_matmul_precision(),
                   cuda_matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
                   cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32) if cuda else None)
    except RuntimeError as e:  # e.g. the new fp32_precision API was used elsewhere in this process
        out["tf32_error"] = str(e).splitlines()[0]
    name = f" ({torch.cuda.get_device_name(dev)})" if cuda else ""
    return dict(device=str(dev) + name, precision=PRECISIONS[bool(bf16)], **out,
                torch=torch.__version__, transformers=transformers.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.anchor.train", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="tinyshakespeare.txt")
    p.add_argument("--tokenizer", required=True, help="GPT-2 tokenizer directory")
    p.add_argument("--seed", type=int, required=True, help="initialisation seed of this parent")
    p.add_argument("--cache", default=None, help="cache dir (default $SYMGRAPH_CACHE/anchor)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-steps", type=int, default=None, help="stop (resumably) after this step")
    p.add_argument("--data-seed", type=int, default=DATA_SEED, help="data-order and dropout seed (authors: 42)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: model, batches, evaluation")
    p.add_argument("--precision", choices=PRECISIONS, default="float32")
    p.add_argument("--retrain", action="store_true", help="remove this parent's checkpoint and model first")
    p.add_argument("--size", choices=list(SIZES), default="paper")
    a = p.parse_args(argv)
    size = SIZES[a.size]
    try:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise AnchorError(f"--device {a.device}: this machine has no CUDA device")
        train(a.corpus, a.tokenizer, a.seed, cache=a.cache, threads=a.threads, max_steps=a.max_steps,
              data_seed=a.data_seed, device=a.device, bf16=a.precision == "bf16", retrain=a.retrain,
              config_overrides=size["config"] or None, **size["train"])
    except AnchorError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

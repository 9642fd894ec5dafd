"""Rotations for quantization on massive residual-stream channels: the ``stream`` variant of
:mod:`benchmarks.bench_rotate`. Its ``outliers`` variant puts outliers in the norm gains, which
folding alone removes; trained LLMs carry theirs in the residual stream itself (Sun et al. 2024,
massive activations; Dettmers et al. 2022, LLM.int8()), where folding leaves them and only a
rotation of the stream spreads them.

The variant: the trained ``plain`` model, ``channels`` channels of its token embedding raised by
``factor`` × the embedding's RMS (:func:`symgraph.rotation.stream.with_massive_channels`), then
fine-tuned ``tune_steps`` steps with the zoo's own optimiser (:func:`benchmarks.train.fit`, the
spec's batch size and peak rate, a data seed of its own) so that its float loss recovers;
``--hold W`` adds W × the mean squared relative distance of those channels at every folded
norm's input to the offset to the fine-tuning loss, so that the model keeps them (it otherwise
learns to cancel them after the first layer). Recorded: the float loss of the plain, the raised
and the fine-tuned model, and the largest over the median channel RMS at every folded norm's
input of each (:func:`symgraph.rotation.stream.norm_input_ratios`). Rows, settings, quantizer,
noise and the resolution rule are :mod:`benchmarks.bench_rotate`'s.
"""
from __future__ import annotations

import argparse
import time

import torch

from symgraph.rotation.stream import norm_input_ratios, norm_inputs, with_massive_channels

from . import evaluate, train, zoo
from .bench_rotate import EVAL_BATCHES, SETTINGS, arguments, header, run_and_write, run_rows, tables
from .provenance import log, table

#: The fine-tuning's data order: a generator of its own, not the plain model's training draw.
STREAM_DATA_SEED = train.DATA_SEED_OFFSET + 64


def _state(model, arch, batches) -> dict:
    """The float loss of ``model`` on ``batches`` and the channel ratio at every folded norm's input
    (on the first batch)."""
    ratios = norm_input_ratios(model, lambda m: evaluate.model_logits(m, arch, batches[0]))
    with torch.no_grad():
        loss = sum(float(evaluate.batch_loss(model, arch, b)) for b in batches) / len(batches)
    return {"loss": loss, "ratios": ratios}


def _held(arch, seen: dict, channels, offset: float, hold: float):
    """The fine-tuning loss: the model's own, plus ``hold`` × the mean squared relative distance of
    the massive ``channels`` at every folded norm's input to ``offset``."""
    def loss_fn(m, b):
        seen.clear()
        loss = evaluate.batch_loss(m, arch, b)
        if not hold:
            return loss
        terms = [(x[:, channels] / offset - 1).pow(2).mean() for xs in seen.values() for x in xs]
        return loss + hold * torch.stack(terms).mean()
    return loss_fn


def stream_variant(arch, plain, channels: int, factor: float, tune_steps: int, hold: float = 0.0, seed: int = 0):
    """``(model, info)``: ``plain`` with massive stream channels, fine-tuned; ``info``: the
    channels, the offset, the steps, the ``plain`` / ``raised`` / ``tuned`` states (:func:`_state`)
    and the training losses' first and last tenth."""
    batches = evaluate.eval_batches(arch, "eval", max_batches=EVAL_BATCHES)
    mass = with_massive_channels(plain, channels=channels, factor=factor, seed=seed)
    info = {"channels": mass.channels, "factor": factor, "offset": mass.offset, "tune_steps": tune_steps,
            "hold": hold, "plain": _state(plain, arch, batches), "raised": _state(mass.model, arch, batches)}
    spec = zoo.get_spec(arch)
    setting = spec.setting("quick")
    gen = torch.Generator().manual_seed(STREAM_DATA_SEED + seed)
    model = mass.model
    t0 = time.perf_counter()
    with norm_inputs(model, detach=False) as seen:
        losses = train.fit(model.train(), train.batch_sampler(spec, setting.batch_size, gen), tune_steps,
                           setting.lr, loss_fn=_held(arch, seen, mass.channels, mass.offset, hold))
    model.eval()
    tenth = max(1, tune_steps // 10)
    info.update(tune_seconds=time.perf_counter() - t0, train_first=sum(losses[:tenth]) / tenth,
                train_last=sum(losses[-tenth:]) / tenth, tuned=_state(model, arch, batches))
    for k in ("plain", "raised", "tuned"):
        log(f"bench_rotate_stream: {arch} {k}: float loss {info[k]['loss']:.4f}, max/median channel RMS at the "
            f"norms' inputs {', '.join(f'{r:.1f}' for r in info[k]['ratios'].values())}")
    return model, info


def run_arch(arch: str, hows, learn_steps: int, train_steps: int, tune_steps: int, channels: int,
             factor: float, hold: float = 0.0, quarot=None) -> dict:
    """The ``stream`` variant of ``arch`` (plain: trained ``train_steps`` steps, seed 0, quick) and
    its losses per rotation and setting."""
    plain = train.train_model(arch, seed=0, size="quick", steps=train_steps)
    model, info = stream_variant(arch, plain, channels, factor, tune_steps, hold)
    return {"arch": arch, "variants": {"stream": {**info, **run_rows(model, arch, hows, learn_steps, quarot,
                                                                      f"{arch} stream")}}}


def markdown(record) -> str:
    lines = header("Rotations for quantization: massive residual-stream channels (issue 64)", record) + [
        f"Variant `stream`: the trained `plain` zoo model (quick, seed 0, {record['train_steps']} steps) with "
        f"{record['channels']} channels of its token embedding raised by {record['factor']:g} × the "
        f"embedding's RMS (`symgraph.rotation.stream.with_massive_channels`), then fine-tuned "
        f"{record['tune_steps']} steps (the zoo's AdamW schedule, batch size and peak rate, its own data "
        "seed" + (f"; plus {record['hold']:g} × the mean squared relative distance of those channels at every "
                  "folded norm's input to the offset, which keeps them massive through the layers"
                  if record.get("hold") else "") + "). Massive channels in the stream survive folding: a norm's "
        "input keeps them. Quantizer, rows, noise and resolution rule as `benchmarks/results/rotate/rotate.md`.", "",
        "## The variant", "",
        "Float loss (first evaluation batches) and max/median channel RMS at each folded norm's input, in "
        "model order (first batch): `plain`, the trained model; `raised`, the channels added, not "
        "trained; `tuned`, after fine-tuning (the model benchmarked).", ""]
    states = [[r["arch"], k, f"{r['variants']['stream'][k]['loss']:.4f}",
               " / ".join(f"{x:.1f}" for x in r["variants"]["stream"][k]["ratios"].values())]
              for r in record["archs"] for k in ("plain", "raised", "tuned")]
    lines += table(["model", "state", "float loss", "max/median channel RMS at the norms' inputs"], states,
                   ["l", "l", "r", "l"])
    lines += ["", "## Losses", ""]
    lines += tables(record, "As in the rotate table: `(L_none − L_rot) / gap` where the gap is resolved, "
                    "else `Δ = L_rot − L_none`.")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments(p, ["llama", "gpt2"], "benchmarks/results/rotate_stream")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--factor", type=float, default=30.0, help="the offset, in units of the embedding's RMS")
    p.add_argument("--tune-steps", type=int, default=60)
    p.add_argument("--hold", type=float, default=0.0,
                   help="weight of a fine-tuning term keeping the channels at every norm's input (0: none)")
    a = p.parse_args(argv)
    record = {"settings": SETTINGS, "train_steps": a.train_steps, "channels": a.channels, "factor": a.factor,
              "tune_steps": a.tune_steps, "hold": a.hold}
    run_and_write(a, argv, "benchmarks.bench_rotate_stream", "rotate_stream", record,
          lambda arch, hows: run_arch(arch, hows, a.learn_steps, a.train_steps, a.tune_steps, a.channels,
                                      a.factor, a.hold, a.quarot), markdown)


if __name__ == "__main__":
    main()

"""The Theus et al. (2025) Tiny Shakespeare table, side by side with symgraph's rows.

``python -m benchmarks.anchor --corpus F --tokenizer DIR`` trains (or loads from the cache) the
protocol's two parents (:mod:`benchmarks.anchor.train`), then for each row of :data:`ROWS` aligns
parent B to parent A with symgraph, evaluates the test loss on an 11-point λ grid and reports the
barrier ``max_λ L(λ) − ½(L(A) + L(B))`` (and Theus et al.'s, ``max_λ L(λ) − (λL_A + (1−λ)L_B)``)
next to the paper's Table 2, in the parents' architecture and in circuit space (heads twice as
wide, :mod:`symgraph.merging.circuits`: the traced program widened in memory; the learned rows
train in that space). The outputs (:mod:`benchmarks.anchor.report`) are rewritten after every
row; rerun with the same ``--out``, a stopped run keeps only the rows of the same commit, code,
device, settings and parents. ``--device cuda`` (or ``fakegpu``, the test device of
:mod:`symgraph.testing.device`) trains the parents and computes every row there. ``--peer-work``
(or ``--peer-src``, or ``--peer-python`` without a venv) adds the rows of Theus et al.'s own code on
the same parents (:mod:`benchmarks.anchor.peer`), learned matching included at their budget
(:data:`LEARN`). ``--size small``: the whole table on parents a CPU trains in minutes;
``--tiny``: a smoke run of the whole command (results in ``<cache>/tiny/results``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..harness import sync
from ..provenance import RESULTS_ROOT, commit_info
from . import data as D
from . import peer
from .peer import PeerError, barrier_theirs
from .report import code_digest, markdown, previous_rows, write  # noqa: F401 - markdown: the table's report
from .train import DATA_SEED, PRECISIONS, SIZES, load_parent, parent_dir, precision_env, read_log
from .train import train as train_parent

LAMBDAS = np.linspace(0.0, 1.0, 11)
DATA_ROWS = 64  # training sequences for the activation statistics

#: row name -> (symgraph align, fold_norms, learned-matching steps; -1: the learned budget)
ROWS = {
    "vanilla": (None, True, 0),
    "activations": ("activations", True, 0),
    "weights": ("weights", True, 0),
    "weights_seen": ("weights", True, 0),  # embedding and head rows of tokens seen in training only
    "weights_cols": ("weights", True, 0),  # seen rows, and each residual block scaled by 1/columns
    "weights_circ": ("weights", True, 0),  # seen rows, heads paired by circuit distance
    "weights_perm": ("weights", False, 0),  # permutations only (as Theus et al.'s --permutations_only)
    "weights_perm_seen": ("weights", False, 0),  # permutations only, seen-token rows
    "weights_perm_folded": ("weights", False, 0),  # permutations only, on the parents with gains folded
    "weights_perm_seen_folded": ("weights", False, 0),  # the same, seen-token rows
    "learned": ("activations", True, -1),
    "learned_perm": ("activations", False, -1),
}
#: rows with Theus et al.'s weight-matching costs: the seen-token rows, and what else they set
SEEN_ROWS = {"weights_seen": {}, "weights_cols": {"block_scale": "columns"},
             "weights_circ": {"head_cost": "circuits"}, "weights_perm_seen": {}, "weights_perm_seen_folded": {}}
#: rows on the parents with their norm gains and shifts folded into their readers (the function
#: unchanged; Theus et al. match in this form): the permutations' costs then do not depend on how
#: a norm's scale is split between its gain and its readers
FOLDED = {"weights_perm_folded", "weights_perm_seen_folded"}
#: ``--tiny``: parents of this config trained for TINY_STEPS steps, the first TINY_TEST test sequences
TINY_CONFIG = dict(n_embd=64, n_layer=2, n_head=4, n_inner=256)
TINY_TRAIN = dict(block_size=64, batch_size=8, epochs=1, eval_every=50, lr=1e-3)
TINY_STEPS, TINY_TEST = 200, 32
TINY_ROWS = ["vanilla", "weights", "weights_seen", "weights_perm", "weights_perm_seen"]
#: ``--size small``: the first SMALL_TEST test sequences
SMALL_TEST = 64
#: learned matching's budget, theirs (``run_merger.sh``: 10 epochs of batch 32, early stopping)
#: and ours (as many steps of the same batches, no early stopping); small: a tenth of the
#: parents' schedule, as their 10 epochs are of the parents' 100
LEARN = {"paper": {"epochs": 10, "batch_size": 32, "max_steps": None},
         "small": {"epochs": 10, "batch_size": 8, "max_steps": 25}}


def gains_folded(model):
    """A copy of ``model`` with its norm gains and shifts folded into their readers
    (:meth:`SymmetryReport.fold`: gains 1, shifts 0, the same function)."""
    import copy
    import symgraph
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    new = symgraph.analyze(m).fold({k: p.detach() for k, p in params.items()})
    with torch.no_grad():
        for k, v in new.items():
            params[k].copy_(v.to(params[k].dtype))
    return m


def _clock(dev: torch.device) -> float:
    sync(dev)
    return time.perf_counter()


def run_row(name, A, B, *, train, test, refine_steps, circuits: bool, eval_bs=8, seen=None, learn=None) -> dict:
    """One row: align B to A as the row says (learned matching trains in the row's space, on
    ``learn``'s batches when given), the curve on the test split in that space, its barrier;
    computed on the parents' device (the batches, ``test`` and ``seen`` live there too)."""
    import symgraph
    from symgraph.merging.driver import circuit_between
    align, fold, steps = ROWS[name]
    steps = refine_steps if steps < 0 else steps
    data = learn if steps and learn else train
    dev = next(A.parameters()).device
    t0 = _clock(dev)
    if name in FOLDED:
        A, B = gains_folded(A), gains_folded(B)
    Bal, note, refined = B, None, None
    options = {"align": align, "fold_norms": fold, "refine_steps": steps, "eval_batch": eval_bs,
               "lambdas": len(LAMBDAS), "test_sequences": int(test.shape[0])}
    if align is not None:
        extra = {"between": circuit_between(A)} if circuits and steps else {}
        if name in SEEN_ROWS:  # Theus et al.: the embedding's and the untied head's rows of tokens seen
            rep = symgraph.analyze(A)
            extra["rows"] = {**rep.input_rows([{"input_ids": seen.reshape(1, -1)}]), **rep.output_rows(seen)}
            extra.update(SEEN_ROWS[name])
        al = symgraph.align(A, B, data[0], data=data if align == "activations" else None,
                            fold_norms=fold, refine=steps, **extra)
        Bal, refined = al.apply(B), getattr(al, "refined", None)
        options.update({k: v for k, v in extra.items() if isinstance(v, str)},
                       seen_rows={k: int(v.numel()) for k, v in extra.get("rows", {}).items()} or None,
                       refine_space=("circuits" if "between" in extra else "heads") if steps else None,
                       data_batches={"batches": len(data), "shape": list(data[0]["input_ids"].shape)}
                       if align == "activations" else None)
    t_align = _clock(dev) - t0
    try:
        curve = symgraph.interpolate(A, Bal, LAMBDAS, lambda m: D.test_loss(m, test, batch_size=eval_bs),
                                     attention="circuits" if circuits else "heads")
    except symgraph.InputError as e:
        curve, note = [], str(e)
    return {"row": name, "space": "circuits" if circuits else "heads", "curve": curve,
            "barrier": symgraph.loss_barrier(curve) if curve else None,
            "barrier_theirs": barrier_theirs(curve) if curve else None, "device": str(dev),
            "align_seconds": t_align, "seconds": _clock(dev) - t0, "refine_steps": steps,
            "refined": refined, "note": note, "options": options}


def _device(name: str) -> torch.device:
    """``name`` as a device: ``fakegpu`` (the test device) registered first; CUDA checked."""
    if name.startswith("fakegpu"):
        from symgraph.testing.device import install
        install()
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise D.AnchorError(f"--device {name}: not a device name ({str(e).splitlines()[0]})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise D.AnchorError(f"--device {name}: this machine has no CUDA device")
    return dev


def learn_batches(train_seqs: torch.Tensor, budget: dict) -> list:
    """The batches of learned matching's budget: ``max_steps`` batches (else ``epochs`` epochs) of
    ``batch_size`` training sequences in the parents' data order."""
    bs = budget["batch_size"]
    steps = budget["max_steps"] or int(budget["epochs"] * D.steps_per_epoch(train_seqs.shape[0], bs))
    out, epoch = [], 0
    while len(out) < steps:
        out += [{"input_ids": x} for x in D.batches(train_seqs, bs, seed=DATA_SEED, epoch=epoch)]
        epoch += 1
    return out[:steps]


def _parents(a, cache: Path, dev: torch.device):
    """Train (unless ``--no-train``) or load the two parents, on ``dev``; ``(models, save_pretrained
    dirs, a summary of each one's train log)``."""
    kw = dict(cache=cache, device=dev, bf16=a.precision == "bf16", retrain=a.retrain)
    models, info = [], []
    for s in a.seeds:
        if a.no_train:
            pass
        elif not a.tiny:
            size = SIZES[a.size]
            train_parent(a.corpus, a.tokenizer, s, max_steps=a.max_steps, config_overrides=size["config"] or None,
                         **size["train"], **kw)
        elif a.retrain or len((read_log(cache, s) or {}).get("train_loss", [])) < TINY_STEPS:
            train_parent(a.corpus, a.tokenizer, s, max_steps=TINY_STEPS, config_overrides=TINY_CONFIG,
                         **TINY_TRAIN, **kw)
        m = load_parent(cache, s).to(dev).eval()
        m.config.use_cache = False  # evaluated whole: no key/value cache (HF builds it from Python lists)
        models.append(m)
        log = read_log(cache, s) or {}
        precision = log.get("precision") or PRECISIONS[bool(log.get("protocol", {}).get("bf16"))]
        info.append({"seed": s, "precision": precision,
                     "device": log.get("device", "cpu"), "torch": (log.get("runs") or [{}])[-1].get("torch"),
                     "steps": len(log.get("train_loss", [])), "done": bool(log.get("done")),
                     **{k: log.get(k) for k in ("best_step", "best_val_loss", "final_test_loss", "stop_reason",
                                                "wall_seconds")}})
    return models, [parent_dir(cache, s) for s in a.seeds], info


def _peer_paths(a):
    """``(source dir, python, work dir, PYTHONPATH)`` of the peer's code: their venv's python
    (created if absent), or ``--peer-python``; None when no ``--peer-*`` flag was given."""
    import shutil
    if not (a.peer_work or a.peer_src or a.peer_python):
        return None
    work = Path(a.peer_work) if a.peer_work else peer.default_work()
    src = Path(a.peer_src) if a.peer_src else peer.source_dir(work)
    peer.check_source(src)
    if not a.peer_python:
        py = peer.ensure_venv(peer.venv_dir(work))
    elif (py := shutil.which(a.peer_python)) is None:
        raise PeerError(f"--peer-python {a.peer_python}: no such interpreter")
    return src, Path(py), work, a.peer_pythonpath


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.anchor", description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default=None, help="default benchmarks/results/anchor (--tiny: <cache>/tiny/results)")
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    ap.add_argument("--size", choices=list(SIZES), default="paper")
    ap.add_argument("--refine-steps", type=int, default=None, help="learned matching's steps (default: LEARN)")
    ap.add_argument("--max-steps", type=int, default=None, help="cap parent training (not the protocol)")
    ap.add_argument("--no-circuits", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, cuda (TF32 off) or fakegpu (the test device)")
    ap.add_argument("--precision", choices=PRECISIONS, default="float32", help="the parents' training")
    ap.add_argument("--retrain", action="store_true", help="train the parents again from scratch")
    ap.add_argument("--no-train", action="store_true", help="use the cached parents as they are")
    ap.add_argument("--tiny", action="store_true", help=f"tiny parents ({TINY_STEPS} steps): a smoke run")
    ap.add_argument("--peer-work", default=None, help="work dir of the peer's code (source, venv, outputs)")
    ap.add_argument("--peer-src", default=None, help=f"their checkout (default WORK/{peer.PEER_NAME})")
    ap.add_argument("--peer-python", default=None, help="run their code with this interpreter instead of a venv")
    ap.add_argument("--peer-pythonpath", default=None, help="PYTHONPATH for --peer-python: a folder with their pins")
    ap.add_argument("--peer-parallel", action="store_true", help="run their code while symgraph's rows run, each "
                    "on half of the CPU cores")
    return ap.parse_args(argv)


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _note(a, size: str, info: list, n_test: int, block: int) -> str:
    """The report's line on what the parents are (and whether they compare to the paper)."""
    done = all(p["done"] for p in info)
    if a.tiny:
        return (f"TINY SMOKE RUN (--tiny): {TINY_CONFIG} parents, {TINY_STEPS} steps, first {n_test} "
                f"test sequences of {block}: not the protocol, not comparable to the paper.")
    if size == "small":
        return (f"SMALL SIZE (--size small): parents {SIZES['small']['config']} trained to the recipe over a "
                f"{SIZES['small']['train']['schedule_steps']}-step schedule (ended by: "
                f"{', '.join(str(p['stop_reason']) for p in info)}{'' if done else '; NOT DONE'}), first "
                f"{n_test} test sequences of {block}: the recipe at a CPU's size, not comparable to the paper's "
                "numbers.")
    return ("Parents trained to early stopping." if done else
            "PARENTS NOT TRAINED TO THE PROTOCOL'S END (--max-steps or a stopped run): not comparable to the paper.")


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    t_start = time.perf_counter()
    size = "tiny" if a.tiny else a.size
    cache = (Path(a.cache) if a.cache else D.default_cache()) / ("" if size == "paper" else size)
    out = Path(a.out) if a.out else (cache / "results" if a.tiny else
                                     RESULTS_ROOT / ("anchor" if size == "paper" else "anchor_" + size))
    rows = a.rows or (TINY_ROWS if a.tiny else list(ROWS))
    block = {"tiny": TINY_TRAIN["block_size"], "small": SIZES["small"]["train"]["block_size"]}.get(size, D.BLOCK_SIZE)
    budget = None if a.tiny else LEARN[size]
    try:
        dev = _device(a.device)
        splits = D.load_splits(a.corpus, a.tokenizer, a.cache)
        peer_paths = _peer_paths(a)
        (A, B), dirs, info = _parents(a, cache, dev)
    except (D.AnchorError, PeerError) as e:
        print(f"benchmarks.anchor: {e}", file=sys.stderr)
        return 2
    eval_bs = 8 if dev.type == "cpu" else 32  # test sequences per batch of the curves
    test = D.sequences(splits["test"], block)[:{"tiny": TINY_TEST, "small": SMALL_TEST}.get(size)].to(dev)
    train_seqs = D.sequences(splits["train"], block).to(dev)
    train = [{"input_ids": train_seqs[i:i + 8]} for i in range(0, min(len(train_seqs), DATA_ROWS), 8)]
    learn = learn_batches(train_seqs, budget) if budget else None
    refine_steps = a.refine_steps if a.refine_steps is not None else (len(learn) if learn else 200)
    peer_learned = [r for r in peer.LEARNED if r in rows]  # their learned matching beside the table's
    seen = splits["train"].to(dev)
    spaces = ("heads",) if a.no_circuits else ("heads", "circuits")
    result = {**{k if k != "source" else "commit_source": v for k, v in commit_info().items()},
              "code_digest": code_digest(), "device": str(dev),
              "env": precision_env(dev, False),  # the table computes in float32 (TF32 off on CUDA)
              "settings": {"tiny": a.tiny, "size": size, "seeds": list(a.seeds), "rows": rows, "spaces": list(spaces),
                           "refine_steps": refine_steps, "learn_budget": budget, "peer_learned": peer_learned,
                           "data_rows": DATA_ROWS, "eval_batch": eval_bs,
                           "lambdas": [float(x) for x in LAMBDAS]},
              "parents": info, "parent_test_loss": [D.test_loss(p, test, batch_size=eval_bs) for p in (A, B)],
              "rows": [], "errors": [], "protocol_note": _note(a, size, info, len(test), block),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "python -m benchmarks.anchor " + shlex.join(argv),
              "driver": os.environ.get("ANCHOR_DRIVER")}  # e.g. benchmarks/anchor/device.sh, which trained the parents
    kept = previous_rows(out, result)
    job = None

    def save():
        result["seconds"] = time.perf_counter() - t_start
        write(result, out, dirs)  # after every row: a stopped run keeps what it measured

    def peer_done(wait: bool) -> bool:
        """Their rows, once their run is over (``wait``: wait for it); False when it failed."""
        nonlocal job
        if job is None or (not wait and job["glue"]["proc"].poll() is None):
            return True
        try:
            result["rows"] += peer.peer_rows(job, B, test=test, lambdas=LAMBDAS, spaces=spaces, eval_bs=eval_bs)
        except Exception as e:  # noqa: BLE001 - one run on a lent machine: record it, keep the rest
            print(f"benchmarks.anchor: {peer.PEER_LABEL}: {e}", file=sys.stderr)
            if not isinstance(e, PeerError):
                traceback.print_exc()
            result["errors"].append(f"{peer.PEER_LABEL}: {_why(e)}")
            return False
        finally:
            job = None
            save()
        return True

    def start_peer(cpus=None):
        src, py, work, pythonpath = peer_paths
        return peer.start_peer(dirs[0], dirs[1], B, test=test, seen=seen, src=src, python=py, work=work,
                               pythonpath=pythonpath, cpus=cpus, learned=peer_learned,
                               learn={**(budget or {}), "tokenizer": a.tokenizer, "train_ids": train_seqs,
                                      "val_ids": D.sequences(splits["validation"], block)})
    save()
    ok = True
    if peer_paths is not None and a.peer_parallel and len(cores := sorted(os.sched_getaffinity(0))) >= 2:
        # their half and ours: each side's wall times on its own cores
        mine, theirs = cores[:len(cores) // 2], cores[len(cores) // 2:]
        try:
            os.sched_setaffinity(0, mine)
            pinned = True
        except OSError:  # a sandbox without CPU affinity: the halves are thread counts only
            pinned, theirs = False, None
        torch.set_num_threads(len(mine))
        result["peer_parallel"] = {"symgraph_cpus": len(mine), "peer_cpus": len(cores) - len(mine), "pinned": pinned}
        job = start_peer(theirs)
    for name in rows:
        for space in spaces:
            if (name, space) in kept:  # measured by a stopped run of this commit on these parents
                result["rows"].append(kept[(name, space)])
                print(f"{name:12s} {space:8s} kept from {out}/results.json (same commit, code and parents)", flush=True)
                continue
            try:
                r = run_row(name, A, B, train=train, test=test, refine_steps=refine_steps, learn=learn,
                            circuits=space == "circuits", seen=seen, eval_bs=eval_bs)
            except Exception as e:  # noqa: BLE001 - one run on a lent machine: record it, go on to the next row
                traceback.print_exc()
                result["errors"].append(f"{name} ({space}): {_why(e)}")
                ok = False
            else:
                print(f"{name:12s} {r['space']:8s} barrier {r['barrier']} (align {r['align_seconds']:.1f} s, "
                      f"{r['seconds']:.1f} s){' ' + r['note'] if r['note'] else ''}", flush=True)
                result["rows"].append(r)
            save()
            ok = peer_done(wait=False) and ok
    if peer_paths is not None and "peer_parallel" not in result:
        job = start_peer()
    ok = peer_done(wait=True) and ok
    print(f"wrote {out}/results.json, report.md, curves.png, train logs ({result['seconds']:.0f} s)")
    return 0 if ok else 2

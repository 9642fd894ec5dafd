"""The Theus et al. (2025) Tiny Shakespeare table, side by side with symgraph's rows.

``python -m benchmarks.anchor --corpus F --tokenizer DIR [--out DIR] [--device cuda]`` trains (or
loads from the cache) the two parents of the protocol (:mod:`benchmarks.anchor.train`, float32),
then for each method aligns parent B to parent A with symgraph, evaluates the test loss on an
11-point λ grid and reports the barrier ``max_λ L(λ) − ½(L(A) + L(B))`` next to the paper's
Table 2, with each row's wall time and options, ``results.json``, ``report.md``, ``curves.png``
and the parents' train logs (:mod:`benchmarks.anchor.report`, rewritten after every row).
Every row is recomputed at the current commit; a run stopped by a time limit, rerun with the
same ``--out``, keeps only the rows of the same commit, code, device, settings and parents.

Rows, in the parents' architecture: vanilla averaging, activation matching, weight matching,
weight matching on the embedding and untied head rows of tokens seen in training only (``weights_seen``, as
Theus et al. match), and with their other two costs on top (``weights_cols``: each residual block
scaled by its columns; ``weights_circ``: heads paired by circuit distance), weight matching with
permutations only (``weights_perm``, ``weights_perm_seen``: ``fold_norms=False``; ``_folded``: on
the parents with their norm gains folded into their readers first, :data:`FOLDED`), learned
matching (residual orthogonal map: symgraph's default on the untied model; and permutations
only: ``fold_norms=False``). In circuit space (heads twice as wide,
:mod:`symgraph.merging.circuits`) the same alignments are interpolated in the wider heads,
(GPT-2's config cannot state the head size: the traced program is widened in memory,
:mod:`symgraph.width.widen`), and the learned rows train in that space. Each row also records
Theus et al.'s barrier definition (``barrier_theirs``: ``max_λ L(λ) − (λL_A + (1−λ)L_B)``).

``--device cuda``: parents trained there (TF32 off), and the alignments, curves and test losses
computed there (models and batches moved; ``fakegpu``, the test device of
:mod:`symgraph.testing.device`, exercises the same path on a machine without a GPU).
``--no-train`` uses the cached parents as they are (e.g. trained beforehand by two concurrent
``python -m benchmarks.anchor.train`` processes, see ``benchmarks/anchor/device.sh``);
``--train-only`` stops after training them.

``--peer-work WORK`` (or ``--peer-src``/``--peer-venv``, or ``--peer-python``/
``--peer-pythonpath`` without a venv) adds the rows of Theus et al.'s own weight matching run on
the same two parents with their pinned transformers (:mod:`benchmarks.anchor.peer`, "peer code
(Theus et al. 6b207cc)"), evaluated by the same code, and of their learned matching at their budget
(``--peer-learned``; :data:`LEARN`: their ``run_merger.sh``'s 10 epochs of batch 32, a tenth of
the parents' schedule at ``--size small``), beside symgraph's learned rows trained for as many
steps of the same batches. ``--size small``: the whole table on parents of the recipe a CPU
trains in minutes (``<cache>/small``, ``benchmarks/results/anchor_small``). ``--tiny``: tiny float32 parents trained for
a few minutes (``<cache>/tiny``, results in ``<cache>/tiny/results``), a smoke run of the whole
command.
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

from . import data as D
from .peer import PeerError, barrier_theirs
from .report import PAPER, code_digest, commit, markdown, previous_rows, write  # noqa: F401 - re-exported
from .train import DATA_SEED, SIZES

LAMBDAS = np.linspace(0.0, 1.0, 11)

#: row name -> (symgraph align, fold_norms, learned-matching steps)
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
#: unchanged; Theus et al. match and interpolate in this form): permutations' costs then do not
#: depend on how a norm's scale is split between its gain and its readers
FOLDED = {"weights_perm_folded", "weights_perm_seen_folded"}


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

#: ``--tiny``: parents of this config trained for TINY_STEPS steps in float32 (a smoke run of the
#: whole command in minutes; not the protocol), evaluated on the first TINY_TEST test sequences
TINY_CONFIG = dict(n_embd=64, n_layer=2, n_head=4, n_inner=256)
TINY_TRAIN = dict(block_size=64, batch_size=8, epochs=1, eval_every=50, lr=1e-3)
TINY_STEPS, TINY_TEST = 200, 32
TINY_ROWS = ["vanilla", "weights", "weights_seen", "weights_perm", "weights_perm_seen"]
#: ``--size small``: the recipe on small parents (:data:`benchmarks.anchor.train.SIZES`), the
#: first SMALL_TEST test sequences
SMALL_TEST = 64
#: learned matching's budget, theirs (``run_merger.sh``: 10 epochs of batch 32, early stopping)
#: and ours (the same number of steps of the same batches, no early stopping); small: a tenth of
#: the parents' schedule, as their 10 epochs are of the parents' 100
LEARN = {"paper": {"epochs": 10, "batch_size": 32, "max_steps": None},
         "small": {"epochs": 10, "batch_size": 8, "max_steps": 25}}


def _batches(seqs: torch.Tensor, batch_size: int, limit: int) -> list:
    return [{"input_ids": seqs[i:i + batch_size]} for i in range(0, min(len(seqs), limit), batch_size)]


def _loss_fn(test: torch.Tensor, batch_size: int):
    def loss(model) -> float:
        return D.test_loss(model, test, batch_size=batch_size)
    return loss


def _clock(dev: torch.device) -> float:
    """``time.perf_counter`` once the device's queued work is done (CUDA runs asynchronously)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def run_row(name, A, B, *, train, test, refine_steps, circuits: bool, eval_bs=8, seen=None, learn=None) -> dict:
    """One row: align B to A as the row says (learned matching trains in the row's space, on
    ``learn``'s batches, its budget, when given), the curve on the test split in that space, its
    barrier; computed on the parents' device (the batches, ``test`` and ``seen`` live there too)."""
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
        if name in SEEN_ROWS:  # Theus et al.: embedding rows of the tokens seen in training, their costs
            rep = symgraph.analyze(A)  # the embedding's rows and the untied head's, as theirs
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
        curve = symgraph.interpolate(A, Bal, LAMBDAS, _loss_fn(test, eval_bs),
                                     attention="circuits" if circuits else "heads")
    except symgraph.InputError as e:
        curve, note = [], str(e)
    barrier = symgraph.loss_barrier(curve) if curve else None
    return {"row": name, "space": "circuits" if circuits else "heads", "barrier": barrier, "curve": curve,
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
    from .train import load_parent, parent_dir, read_log, train as train_parent
    kw = dict(device=dev, bf16=a.precision == "bf16", retrain=a.retrain)
    models, dirs, info = [], [], []
    for s in a.seeds:
        if a.no_train:
            pass
        elif not a.tiny:
            size = SIZES[a.size]
            train_parent(a.corpus, a.tokenizer, s, cache=cache, max_steps=a.max_steps,
                         config_overrides=size["config"] or None, **size["train"], **kw)
        elif a.retrain or len((read_log(cache, s) or {}).get("train_loss", [])) < TINY_STEPS:
            train_parent(a.corpus, a.tokenizer, s, cache=cache, max_steps=TINY_STEPS,
                         config_overrides=TINY_CONFIG, **TINY_TRAIN, **kw)
        m = load_parent(cache, s).to(dev).eval()
        m.config.use_cache = False  # evaluated whole: no key/value cache (HF builds it from Python lists)
        models.append(m)
        dirs.append(parent_dir(cache, s))
        log = read_log(cache, s) or {}
        info.append({"seed": s, "precision": log.get("precision") or
                     ("bf16" if log.get("protocol", {}).get("bf16") else "float32"),
                     "device": log.get("device", "cpu"), "torch": (log.get("runs") or [{}])[-1].get("torch"),
                     "steps": len(log.get("train_loss", [])), "best_step": log.get("best_step"),
                     "best_val_loss": log.get("best_val_loss"), "final_test_loss": log.get("final_test_loss"),
                     "stop_reason": log.get("stop_reason"), "done": bool(log.get("done")),
                     "wall_seconds": log.get("wall_seconds")})
    return models, dirs, info


def _peer_paths(a):
    """``(source dir, python, work dir, PYTHONPATH)`` of the peer's code: their venv's python
    (created if absent), or ``--peer-python`` with ``--peer-pythonpath``; None when no
    ``--peer-*`` flag was given."""
    import shutil
    from . import peer
    if not (a.peer_work or a.peer_src or a.peer_venv or a.peer_python):
        return None
    work = Path(a.peer_work) if a.peer_work else peer.default_work()
    src = Path(a.peer_src) if a.peer_src else peer.source_dir(work)
    peer.check_source(src)
    if a.peer_python:
        py = shutil.which(a.peer_python)
        if py is None:
            raise PeerError(f"--peer-python {a.peer_python}: no such interpreter")
        return src, Path(py), work, a.peer_pythonpath
    py = peer.ensure_venv(Path(a.peer_venv) if a.peer_venv else peer.venv_dir(work))
    return src, py, work, a.peer_pythonpath


def _args(argv):
    from . import peer
    ap = argparse.ArgumentParser(prog="python -m benchmarks.anchor", description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default=None, help="default benchmarks/results/anchor (--tiny: <cache>/tiny/results)")
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    ap.add_argument("--size", choices=list(SIZES), default="paper",
                    help="paper (the protocol) or small (the recipe on parents a CPU trains in minutes, <cache>/small)")
    ap.add_argument("--refine-steps", type=int, default=None,
                    help="learned matching's steps (default: their budget, see LEARN; --tiny 200)")
    ap.add_argument("--data-rows", type=int, default=64, help="training sequences for activation statistics")
    ap.add_argument("--max-steps", type=int, default=None, help="cap parent training (not the protocol)")
    ap.add_argument("--no-circuits", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda (TF32 off) or fakegpu (the test device): "
                    "parents' training, alignments, curves and test losses")
    ap.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                    help="the parents' training: float32 (the protocol) or bf16 autocast (a variant)")
    ap.add_argument("--retrain", action="store_true", help="train the parents again from scratch")
    ap.add_argument("--no-train", action="store_true", help="use the cached parents as they are")
    ap.add_argument("--train-only", action="store_true", help="train the parents, then stop")
    ap.add_argument("--eval-batch", type=int, default=None,
                    help="test sequences per batch of the curves (default 8 on the CPU, 32 elsewhere)")
    ap.add_argument("--tiny", action="store_true", help=f"tiny float32 parents ({TINY_STEPS} steps, <cache>/tiny): "
                    "a smoke run of the whole command, not the protocol")
    ap.add_argument("--peer-work", default=None, help="work dir of the peer's code (source, venv, outputs; see "
                    "benchmarks.anchor.peer): adds the rows of Theus et al.'s own weight matching")
    ap.add_argument("--peer-src", default=None, help="their checkout at 6b207cc (default WORK/" + peer.PEER_NAME + ")")
    ap.add_argument("--peer-venv", default=None, help="their venv (default WORK/peer-venv, created if absent)")
    ap.add_argument("--peer-python", default=None, help="run their code with this interpreter instead of a venv")
    ap.add_argument("--peer-pythonpath", default=None,
                    help="PYTHONPATH for --peer-python: a folder with their pins (transformers==4.50.1, ...)")
    ap.add_argument("--peer-variants", nargs="+", choices=list(peer.VARIANTS), default=list(peer.VARIANTS))
    ap.add_argument("--peer-learned", nargs="*", choices=list(peer.LEARNED), default=None,
                    help="their learned matching (train_merger.py) at their budget (default: as the table's learned rows)")
    ap.add_argument("--peer-parallel", action="store_true",
                    help="run their weight matching (CPU) while symgraph's rows run, on the other half of the "
                         "CPU cores (each side's time is on its half); their rows are evaluated once it is done")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from . import peer
    from .train import precision_env
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    t_start = time.perf_counter()
    size = "tiny" if a.tiny else a.size
    cache = (Path(a.cache) if a.cache else D.default_cache()) / ("" if size == "paper" else size)
    results = Path(__file__).resolve().parents[1] / "results"
    out = Path(a.out) if a.out else (cache / "results" if a.tiny else results / ("anchor" if size == "paper" else "anchor_" + size))
    rows = a.rows or (TINY_ROWS if a.tiny else list(ROWS))
    block = {"tiny": TINY_TRAIN["block_size"], "small": SIZES["small"]["train"]["block_size"]}.get(size, D.BLOCK_SIZE)
    budget = None if a.tiny else LEARN[size]
    try:
        dev = _device(a.device)
        splits = D.load_splits(a.corpus, a.tokenizer, a.cache)
        peer_paths = None if a.train_only else _peer_paths(a)
        parents, dirs, info = _parents(a, cache, dev)
    except (D.AnchorError, PeerError) as e:
        print(f"benchmarks.anchor: {e}", file=sys.stderr)
        return 2
    if a.train_only:
        print(f"parents trained: {', '.join(str(d) for d in dirs)}")
        return 0
    env = precision_env(dev, False)  # the table computes in float32 (TF32 off on CUDA)
    eval_bs = a.eval_batch or (8 if dev.type == "cpu" else 32)
    test = D.sequences(splits["test"], block)[:{"tiny": TINY_TEST, "small": SMALL_TEST}.get(size)].to(dev)
    train_seqs = D.sequences(splits["train"], block).to(dev)
    train = _batches(train_seqs, 8, a.data_rows)
    learn = learn_batches(train_seqs, budget) if budget else None
    refine_steps = a.refine_steps if a.refine_steps is not None else (len(learn) if learn else 200)
    peer_learned = [r for r in peer.LEARNED if r in rows] if a.peer_learned is None else a.peer_learned
    seen = splits["train"].to(dev)
    done = all(p["done"] for p in info)
    note = ("Parents trained to early stopping." if done else
            "PARENTS NOT TRAINED TO THE PROTOCOL'S END (--max-steps or a stopped run): not comparable to the paper.")
    if size == "small":
        note = (f"SMALL SIZE (--size small): parents {SIZES['small']['config']} trained to the recipe over a "
                f"{SIZES['small']['train']['schedule_steps']}-step schedule (ended by: "
                f"{', '.join(str(p['stop_reason']) for p in info)}{'' if done else '; NOT DONE'}), first "
                f"{len(test)} test sequences of {block}: the recipe at a CPU's size, not comparable to the paper's numbers.")
    if a.tiny:
        note = (f"TINY SMOKE RUN (--tiny): {TINY_CONFIG} parents, {TINY_STEPS} steps, first {len(test)} "
                f"test sequences of {block}: not the protocol, not comparable to the paper.")
    spaces = ("heads",) if a.no_circuits else ("heads", "circuits")
    result = {**{k if k != "source" else "commit_source": v for k, v in commit().items()},
              "code_digest": code_digest(), "device": str(dev), "env": env,
              "settings": {"tiny": a.tiny, "size": size, "seeds": list(a.seeds), "rows": rows, "spaces": list(spaces),
                           "refine_steps": refine_steps, "learn_budget": budget, "peer_learned": peer_learned,
                           "data_rows": a.data_rows, "eval_batch": eval_bs,
                           "lambdas": [float(x) for x in LAMBDAS]},
              "parents": info, "parent_test_loss": [D.test_loss(p, test, batch_size=eval_bs) for p in parents],
              "rows": [], "errors": [], "protocol_note": note, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "python -m benchmarks.anchor " + shlex.join(argv),
              "driver": os.environ.get("ANCHOR_DRIVER")}  # e.g. benchmarks/anchor/device.sh, which trained the parents
    A, B = parents
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
            result["rows"] += peer.peer_rows(job, B, test=test, lambdas=LAMBDAS, spaces=spaces, eval_bs=eval_bs,
                                             echo=lambda m: print(m, flush=True))
        except Exception as e:  # noqa: BLE001 - one run on a lent machine: record it, keep the rest
            print(f"benchmarks.anchor: {peer.PEER_LABEL}: {e}", file=sys.stderr)
            if not isinstance(e, PeerError):
                traceback.print_exc()
            result["errors"].append(f"{peer.PEER_LABEL}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return False
        finally:
            job = None
            save()
        return True

    def start_peer(cpus=None):
        src, py, work, pythonpath = peer_paths
        return peer.start_peer(dirs[0], dirs[1], B, test=test, seen=seen, src=src, python=py, work=work,
                               variants=a.peer_variants, pythonpath=pythonpath, cpus=cpus, learned=peer_learned,
                               learn={**(budget or {}), "tokenizer": a.tokenizer, "train_ids": train_seqs,
                                      "val_ids": D.sequences(splits["validation"], block)})
    save()
    ok = True
    if peer_paths is not None and a.peer_parallel:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # their half and ours: each side's wall times on its own cores
            mine, theirs = cores[:len(cores) // 2], cores[len(cores) // 2:]
            try:
                os.sched_setaffinity(0, mine)
                pinned = True
            except OSError:  # a sandbox without CPU affinity: the halves are thread counts only
                pinned, theirs = False, None
            torch.set_num_threads(len(mine))
            result["peer_parallel"] = {"symgraph_cpus": len(mine), "peer_cpus": len(cores) - len(mine),
                                       "pinned": pinned}
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
                result["errors"].append(f"{name} ({space}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                ok = False
                save()
                continue
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

"""The Theus et al. (2025) Tiny Shakespeare table, side by side with symgraph's rows.

``python -m benchmarks.anchor --corpus F --tokenizer DIR [--out DIR]`` trains (or loads from the
cache) the two parents of the protocol (:mod:`benchmarks.anchor.train`), then for each method
aligns parent B to parent A with symgraph, evaluates the test loss on an 11-point λ grid and
reports the barrier ``max_λ L(λ) − ½(L(A) + L(B))`` next to the paper's Table 2, with each
row's wall time, ``results.json``, ``report.md`` and ``curves.png``.

Rows, in the parents' architecture: vanilla averaging, activation matching, weight matching,
weight matching on the embedding rows of tokens seen in training only (``weights_seen``, as
Theus et al. match), and with their other two costs on top (``weights_cols``: each residual block
scaled by its columns; ``weights_circ``: heads paired by circuit distance), weight matching with
permutations only (``weights_perm``, ``weights_perm_seen``: ``fold_norms=False``), learned
matching (residual orthogonal map: symgraph's default on the untied model; and permutations
only: ``fold_norms=False``). In circuit space (heads twice as wide,
:mod:`symgraph.merging.circuits`) the same alignments are interpolated in the wider heads,
(GPT-2's config cannot state the head size: the traced program is widened in memory,
:mod:`symgraph.merging.widen`), and the learned rows train in that space. Each row also records
Theus et al.'s barrier definition (``barrier_theirs``: ``max_λ L(λ) − (λL_A + (1−λ)L_B)``).

``--peer-work WORK`` (or ``--peer-src``/``--peer-venv``) adds the rows of Theus et al.'s own
weight matching run on the same two parents in its own venv (:mod:`benchmarks.anchor.peer`,
"peer code (Theus et al. 6b207cc)"), evaluated by the same code. ``--tiny``: tiny float32
parents trained for a few minutes (``<cache>/tiny``, results in ``<cache>/tiny/results``), a
smoke run of the whole command.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import data as D
from .peer import PEER_LABEL, PeerError, barrier_theirs

#: Theus et al. 2025, Table 2, GPT-2 on Tiny Shakespeare (loss barriers; circuit space for the
#: aligned rows, as their code measures them).
PAPER = {"vanilla": 2.02, "activations": 1.43, "weights": 0.34, "learned": 0.02, "learned_perm": 0.63}
LAMBDAS = np.linspace(0.0, 1.0, 11)

#: row name -> (symgraph align, fold_norms, learned-matching steps)
ROWS = {
    "vanilla": (None, True, 0),
    "activations": ("activations", True, 0),
    "weights": ("weights", True, 0),
    "weights_seen": ("weights", True, 0),  # token-embedding rows of tokens seen in training only
    "weights_cols": ("weights", True, 0),  # seen rows, and each residual block scaled by 1/columns
    "weights_circ": ("weights", True, 0),  # seen rows, heads paired by circuit distance
    "weights_perm": ("weights", False, 0),  # permutations only (as Theus et al.'s --permutations_only)
    "weights_perm_seen": ("weights", False, 0),  # permutations only, seen-token rows
    "learned": ("activations", True, -1),
    "learned_perm": ("activations", False, -1),
}

#: rows with Theus et al.'s weight-matching costs: the seen-token rows, and what else they set
SEEN_ROWS = {"weights_seen": {}, "weights_cols": {"block_scale": "columns"},
             "weights_circ": {"head_cost": "circuits"}, "weights_perm_seen": {}}
#: ``--tiny``: parents of this config trained for TINY_STEPS steps in float32 (a smoke run of the
#: whole command in minutes; not the protocol), evaluated on the first TINY_TEST test sequences
TINY_CONFIG = dict(n_embd=64, n_layer=2, n_head=4, n_inner=256)
TINY_TRAIN = dict(block_size=64, batch_size=8, epochs=1, eval_every=50, bf16=False, lr=1e-3)
TINY_STEPS, TINY_TEST = 200, 32
TINY_ROWS = ["vanilla", "weights", "weights_seen", "weights_perm", "weights_perm_seen"]


def _batches(seqs: torch.Tensor, batch_size: int, limit: int) -> list:
    return [{"input_ids": seqs[i:i + batch_size]} for i in range(0, min(len(seqs), limit), batch_size)]


def _loss_fn(test: torch.Tensor, batch_size: int):
    def loss(model) -> float:
        return D.test_loss(model, test, batch_size=batch_size)
    return loss


def run_row(name, A, B, *, train, test, refine_steps, circuits: bool, eval_bs=8, seen=None) -> dict:
    """One row: align B to A as the row says (learned matching trains in the row's space), the
    curve on the test split in that space, its barrier."""
    import symgraph
    from symgraph.merging.circuits import circuit_between
    align, fold, steps = ROWS[name]
    steps = refine_steps if steps < 0 else steps
    t0 = time.perf_counter()
    Bal, note, refined = B, None, None
    if align is not None:
        extra = {"between": circuit_between(A)} if circuits and steps else {}
        if name in SEEN_ROWS:  # Theus et al.: embedding rows of the tokens seen in training, their costs
            extra["rows"] = symgraph.analyze(A).input_rows([{"input_ids": seen.reshape(1, -1)}])
            extra.update(SEEN_ROWS[name])
        al = symgraph.align(A, B, train[0], data=train if align == "activations" else None,
                            fold_norms=fold, refine=steps, **extra)
        Bal, refined = al.apply(B), getattr(al, "refined", None)
    t_align = time.perf_counter() - t0
    try:
        curve = symgraph.interpolate(A, Bal, LAMBDAS, _loss_fn(test, eval_bs),
                                     attention="circuits" if circuits else "heads")
    except symgraph.InputError as e:
        curve, note = [], str(e)
    barrier = symgraph.loss_barrier(curve) if curve else None
    return {"row": name, "space": "circuits" if circuits else "heads", "barrier": barrier, "curve": curve,
            "barrier_theirs": barrier_theirs(curve) if curve else None,
            "align_seconds": t_align, "seconds": time.perf_counter() - t0, "refine_steps": steps,
            "refined": refined, "note": note}


def markdown(result: dict) -> str:
    rows = {(r["row"], r["space"]): r for r in result["rows"]}
    van = rows.get(("vanilla", "heads"), {}).get("barrier")
    lines = ["# Theus et al. 2025 protocol: GPT-2 on Tiny Shakespeare", "",
             f"Parents' test loss: {', '.join(f'{x:.3f}' for x in result['parent_test_loss'])} "
             f"(paper: about 5.28). {result['protocol_note']}", "",
             "| method | paper (circuit space) | symgraph, parents' architecture | × vanilla | symgraph, circuit space | wall s |",
             "|---|---|---|---|---|---|"]
    for name in ROWS:
        h, c = rows.get((name, "heads")), rows.get((name, "circuits"))
        hb = "—" if h is None or h["barrier"] is None else f"{h['barrier']:.3f}"
        ratio = "—" if h is None or h["barrier"] is None or not van else f"{h['barrier'] / van:.2f}"
        cb = "—" if c is None else (f"{c['barrier']:.3f}" if c["barrier"] is not None else "n/a")
        secs = sum(r["seconds"] for r in (h, c) if r)
        paper = f"{PAPER[name]:.2f}" if name in PAPER else "—"
        lines.append(f"| {name} | {paper} | {hb} | {ratio} | {cb} | {secs:.0f} |")
    notes = sorted({r["note"] for r in result["rows"] if r.get("note")})
    if notes:
        lines += ["", "Circuit space not evaluated: " + " ".join(notes)]
    lines += _peer_markdown(result, rows)
    lines += ["", "Regenerate: `" + result["command"] + "`"]
    return "\n".join(lines) + "\n"


def _peer_markdown(result: dict, rows: dict) -> list:
    peer = [r for r in result["rows"] if r.get("by") == "peer"]
    if not peer:
        return []
    info = peer[0]["peer"]
    v = info.get("versions", {})
    out = ["", f"## {PEER_LABEL} on the same parents", "",
           f"Their `weight_matching` through their `GPTMerger` (commit {(info.get('commit') or 'unknown')[:7]}, "
           f"transformers {v.get('transformers')}, torch {v.get('torch')}, own venv); each aligned B evaluated by "
           "this benchmark's code on the same test split: heads = the factors interpolated in their absorbed form "
           "(RMSNorm, gains 1), circuits = their space (equal to their merger at λ = 0.5: column Δ merger). "
           "Barriers: max L − mean of the ends (theirs: max of L(λ) − (λL_A + (1−λ)L_B)). `_proj`: with their "
           "merger's untrained random near-identity projection, as their eval.py measures weight matching; "
           "`_seen`: embedding rows of tokens seen in training.", "",
           "| method | peer, heads | peer, circuits | peer, circuits (their barrier) | symgraph, circuits | "
           "symgraph, circuits (their barrier) | their weight matching s | symgraph align s | B loss Δ | Δ merger |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    names = list(dict.fromkeys(r["row"] for r in peer))
    by = {(r["row"], r["space"]): r for r in peer}
    for name in names:
        h, c = by.get((name, "heads")), by.get((name, "circuits"))
        any_ = h or c
        mine = rows.get((name[len("peer_"):].removesuffix("_proj"), "circuits"))
        f = (lambda r, k="barrier": "—" if r is None or r.get(k) is None else f"{r[k]:.4f}")
        pi = any_["peer"]
        dm = "—" if pi.get("mid_loss_their_merger") is None else f"{abs(pi['mid_loss_ours'] - pi['mid_loss_their_merger']):.1e}"
        out.append(f"| {name} | {f(h)} | {f(c)} | {f(c, 'barrier_theirs')} | {f(mine)} | {f(mine, 'barrier_theirs')} | "
                   f"{any_['align_seconds']:.2f} | "
                   f"{'—' if mine is None else format(mine['align_seconds'], '.2f')} | {pi['b_loss_rel_change']:.1e} | {dm} |")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in result["rows"]:
        if r["curve"]:
            xs, ys = zip(*sorted(r["curve"]))
            ax.plot(xs, ys, marker="o", ms=3, label=f"{r['row']} ({r['space']})")
    ax.set_xlabel("λ (1 = parent A)")
    ax.set_ylabel("test loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parents(a, cache: Path):
    """Train (or load) the two parents; ``(models, save_pretrained dirs, all done)``."""
    from .train import load_parent, parent_dir, read_log, train as train_parent
    models, dirs, done = [], [], []
    for s in a.seeds:
        if not a.tiny:
            train_parent(a.corpus, a.tokenizer, s, cache=cache, max_steps=a.max_steps)
        elif len((read_log(cache, s) or {}).get("train_loss", [])) < TINY_STEPS:
            train_parent(a.corpus, a.tokenizer, s, cache=cache, max_steps=TINY_STEPS,
                         config_overrides=TINY_CONFIG, **TINY_TRAIN)
        models.append(load_parent(cache, s).eval())
        dirs.append(parent_dir(cache, s))
        done.append(bool((read_log(cache, s) or {}).get("done")))
    return models, dirs, all(done)


def _peer_paths(a):
    """``(source dir, venv python, work dir)`` of the peer's code, the venv created if absent;
    None when no ``--peer-*`` flag was given."""
    from . import peer
    if not (a.peer_work or a.peer_src or a.peer_venv):
        return None
    work = Path(a.peer_work) if a.peer_work else peer.default_work()
    src = Path(a.peer_src) if a.peer_src else peer.source_dir(work)
    peer.check_source(src)
    py = peer.ensure_venv(Path(a.peer_venv) if a.peer_venv else peer.venv_dir(work))
    return src, py, work


def main(argv=None) -> int:
    from . import peer
    ap = argparse.ArgumentParser(prog="python -m benchmarks.anchor", description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default=None, help="default benchmarks/results/anchor (--tiny: <cache>/tiny/results)")
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    ap.add_argument("--refine-steps", type=int, default=200)
    ap.add_argument("--data-rows", type=int, default=64, help="training sequences for activation statistics")
    ap.add_argument("--max-steps", type=int, default=None, help="cap parent training (not the protocol)")
    ap.add_argument("--no-circuits", action="store_true")
    ap.add_argument("--tiny", action="store_true", help=f"tiny float32 parents ({TINY_STEPS} steps, <cache>/tiny): "
                    "a smoke run of the whole command, not the protocol")
    ap.add_argument("--peer-work", default=None, help="work dir of the peer's code (source, venv, outputs; see "
                    "benchmarks.anchor.peer): adds the rows of Theus et al.'s own weight matching")
    ap.add_argument("--peer-src", default=None, help="their checkout at 6b207cc (default WORK/" + peer.PEER_NAME + ")")
    ap.add_argument("--peer-venv", default=None, help="their venv (default WORK/peer-venv, created if absent)")
    ap.add_argument("--peer-variants", nargs="+", choices=list(peer.VARIANTS), default=list(peer.VARIANTS))
    a = ap.parse_args(argv)
    cache = (Path(a.cache) if a.cache else D.default_cache()) / ("tiny" if a.tiny else "")
    out = Path(a.out) if a.out else (cache / "results" if a.tiny else Path(__file__).resolve().parents[1] / "results" / "anchor")
    rows = a.rows or (TINY_ROWS if a.tiny else list(ROWS))
    block = TINY_TRAIN["block_size"] if a.tiny else D.BLOCK_SIZE
    try:
        splits = D.load_splits(a.corpus, a.tokenizer, a.cache)
        peer_paths = _peer_paths(a)
    except (D.AnchorError, PeerError) as e:
        print(f"benchmarks.anchor: {e}", file=sys.stderr)
        return 2
    parents, dirs, done = _parents(a, cache)
    test = D.sequences(splits["test"], block)[:TINY_TEST if a.tiny else None]
    train = _batches(D.sequences(splits["train"], block), 8, a.data_rows)
    note = ("Parents trained to early stopping." if done else
            "PARENTS NOT TRAINED TO THE PROTOCOL'S END (--max-steps): not comparable to the paper.")
    if a.tiny:
        note = (f"TINY SMOKE RUN (--tiny): {TINY_CONFIG} parents, {TINY_STEPS} float32 steps, first {len(test)} "
                f"test sequences of {block}: not the protocol, not comparable to the paper.")
    result = {"parent_test_loss": [D.test_loss(p, test) for p in parents], "rows": [], "protocol_note": note,
              "command": "python -m benchmarks.anchor --corpus CORPUS --tokenizer TOKENIZER_DIR"
                         + (" --tiny" if a.tiny else "") + (" --peer-work WORK" if peer_paths else "")}
    A, B = parents
    kept = _previous_rows(out, result["parent_test_loss"], a.refine_steps)
    spaces = ("heads",) if a.no_circuits else ("heads", "circuits")
    for name in rows:
        for space in spaces:
            if (name, space) in kept:  # measured by an earlier run on these parents
                result["rows"].append(kept[(name, space)])
                print(f"{name:12s} {space:8s} kept from {out}/results.json", flush=True)
                continue
            r = run_row(name, A, B, train=train, test=test, refine_steps=a.refine_steps,
                        circuits=space == "circuits", seen=splits["train"])
            print(f"{name:12s} {r['space']:8s} barrier {r['barrier']} ({r['seconds']:.0f} s){' ' + r['note'] if r['note'] else ''}",
                  flush=True)
            result["rows"].append(r)
            write(result, out)  # after every row: a stopped run keeps what it measured
    if peer_paths is not None:
        src, py, work = peer_paths
        try:
            result["rows"] += peer.peer_rows(dirs[0], dirs[1], B, test=test, seen=splits["train"], src=src,
                                             python=py, work=work, lambdas=LAMBDAS, spaces=spaces,
                                             variants=a.peer_variants, echo=lambda m: print(m, flush=True))
        except PeerError as e:
            print(f"benchmarks.anchor: {PEER_LABEL}: {e}", file=sys.stderr)
            write(result, out)
            return 2
        write(result, out)
    print(f"wrote {out}/results.json, report.md, curves.png")
    return 0


def _previous_rows(out: Path, parent_loss: list, refine_steps: int) -> dict:
    """Rows of an earlier (stopped) run on the same parents and settings, keyed (row, space)."""
    try:
        prev = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    old = prev.get("parent_test_loss", [])
    if len(old) != len(parent_loss) or not np.allclose(old, parent_loss, rtol=0, atol=1e-9):
        return {}
    return {(r["row"], r["space"]): r for r in prev.get("rows", [])
            if r["row"] in ROWS and (ROWS[r["row"]][2] >= 0 or r.get("refine_steps") == refine_steps)}


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result))
    plot(result, out / "curves.png")

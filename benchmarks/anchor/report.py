"""The anchor table's outputs: ``results.json``, ``report.md``, ``curves.png`` and the parents'
train logs, written into ``--out`` after every row; and which rows an earlier, stopped run of the
same code on the same parents may lend a resumed one."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from ..provenance import REPO_ROOT, cell, pyplot, save_figure, table, write_result
from .peer import PEER_LABEL

#: Theus et al. 2025, Table 2, GPT-2 on Tiny Shakespeare (loss barriers; circuit space for the
#: aligned rows, as their code measures them; vanilla: the parents' own architecture)
PAPER = {"vanilla": 2.02, "activations": 1.43, "weights": 0.34, "learned": 0.02, "learned_perm": 0.63}


def code_digest(root: Path = REPO_ROOT) -> str:
    """sha256 (16 hex digits) of the code a table depends on: ``symgraph/**/*.py`` and
    ``benchmarks/anchor/*.py``, by relative path and content."""
    h = hashlib.sha256()
    for f in sorted([*(root / "symgraph").rglob("*.py"), *(root / "benchmarks" / "anchor").glob("*.py")]):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def previous_rows(out: Path, result: dict) -> dict:
    """Rows of an earlier, stopped run that this one may keep, keyed ``(row, space)``: only from
    the same commit (known, and the tree not dirty), the same code digest, the same parents (test
    losses), device and settings; else none (every row is recomputed). Peer rows are always rerun."""
    try:
        prev = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if result.get("commit") is None or result.get("dirty"):
        return {}
    if any(prev.get(k) != result.get(k) for k in ("commit", "code_digest", "device", "settings")):
        return {}
    old, new = prev.get("parent_test_loss", []), result["parent_test_loss"]
    if len(old) != len(new) or not np.allclose(old, new, rtol=0, atol=1e-9):
        return {}
    return {(r["row"], r["space"]): r for r in prev.get("rows", []) if r.get("by") != "peer"}


def _header(result: dict) -> list:
    env = result.get("env") or {}
    par = sorted({f"{p.get('precision')} on {p.get('device')}" for p in result.get("parents") or []}) or ["unknown"]
    tf32 = env.get("cuda_matmul_allow_tf32") is False and env.get("cudnn_allow_tf32") is False
    return [f"Computed on **{env.get('device', result.get('device', 'cpu'))}** in **float32** (matmul precision "
            f"{env.get('float32_matmul_precision', '?')}{', TF32 off' if tf32 else ''}), "
            f"torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}; commit "
            f"{(result.get('commit') or 'unknown')[:10]}{' (dirty tree)' if result.get('dirty') else ''}, code digest "
            f"{result.get('code_digest', '?')}. Parents trained in **{', '.join(par)}**.", "",
            f"Parents' test loss: {', '.join(f'{x:.3f}' for x in result['parent_test_loss'])} "
            f"(paper: about 5.28). {result['protocol_note']}"]


def _pair(rows: dict, name: str) -> tuple:
    return rows.get((name, "heads")), rows.get((name, "circuits"))


def markdown(result: dict) -> str:
    rows = {(r["row"], r["space"]): r for r in result["rows"] if r.get("by") != "peer"}
    van = rows.get(("vanilla", "heads"), {}).get("barrier")
    lines = ["# Theus et al. 2025 protocol: GPT-2 on Tiny Shakespeare", "", *_header(result), ""]
    cells = []
    for name in dict.fromkeys(r for r, _ in rows):
        h, c = _pair(rows, name)
        hb = None if h is None else h["barrier"]
        ratio = "—" if hb is None or not van else f"{hb / van:.2f}"
        cells.append([name, cell(PAPER.get(name), ".2f"), cell(hb), ratio,
                      "—" if c is None else cell(c["barrier"], none="n/a"), cell((c or {}).get("barrier_theirs")),
                      f"{max((r.get('align_seconds') or 0.0) for r in (h, c) if r):.1f}",
                      f"{sum(r['seconds'] for r in (h, c) if r):.0f}"])
    lines += table(["method", "paper", "symgraph, parents' architecture", "× vanilla", "symgraph, circuit space",
                    "circuit space (their barrier)", "align s", "wall s"], cells)
    lines += ["", "Paper: circuit space for the aligned rows, the parents' architecture for vanilla. Barrier: "
              "max L − mean of the ends; theirs: max of L(λ) − (λL_A + (1−λ)L_B). align s: the alignment "
              "alone, the longer of the two spaces (learned rows: their training included); wall s: both "
              "spaces, curves included."]
    budget = (result.get("settings") or {}).get("learn_budget")
    if budget:
        lines += ["", f"Learned rows: {result['settings'].get('refine_steps')} steps of batches of "
                  f"{budget['batch_size']} training sequences in the parents' data order (their budget: "
                  + (f"{budget['max_steps']} steps" if budget.get("max_steps") else f"{budget['epochs']} epochs")
                  + f" of batch {budget['batch_size']}, as their learned matching below), λ ~ U(0.4, 0.6), "
                  "Adam lr 1e-3, no early stopping; activation statistics from the same batches."]
    notes = sorted({r["note"] for r in result["rows"] if r.get("note")})
    if notes:
        lines += ["", "Circuit space not evaluated: " + " ".join(notes)]
    if result.get("errors"):
        lines += ["", "**Errors** (rows not measured): " + "; ".join(result["errors"])]
    lines += _peer_markdown(result, rows)
    lines += ["", "Regenerate: `" + (result.get("driver") or result["command"]) + "`"
              + (f" (which ran `{result['command']}`)" if result.get("driver") else "")]
    return "\n".join(lines) + "\n"


def _peer_markdown(result: dict, rows: dict) -> list:
    peer = [r for r in result["rows"] if r.get("by") == "peer"]
    if not peer:
        return []
    info, par = peer[0]["peer"], result.get("peer_parallel")
    v = info.get("versions", {})
    out = ["", f"## {PEER_LABEL} on the same parents", "",
           f"Their `weight_matching` through their `GPTMerger` (commit {(info.get('commit') or 'unknown')[:7]}, "
           f"transformers {v.get('transformers')}, torch {v.get('torch')}, run on the CPU as their code runs); each "
           f"aligned B evaluated by this benchmark's code on the same test split (on {peer[0].get('device', 'cpu')}): "
           "heads = the factors interpolated in their absorbed form "
           "(RMSNorm, gains 1), circuits = their space (equal to their merger at λ = 0.5: column Δ merger). "
           "Barriers: max L − mean of the ends (theirs: max of L(λ) − (λL_A + (1−λ)L_B)). `_proj`: with their "
           "merger's untrained random near-identity projection, as their eval.py measures weight matching; "
           "`_seen`: embedding rows of tokens seen in training. `peer_learned`, `peer_learned_perm`: their "
           "learned matching, their `train_merger.py`'s `run_training_and_save` (HF Trainer: AdamW lr 3e-4, cosine, "
           "5% warm-up, validation every 50 steps, early stopping after 10, best kept; seen rows) with their "
           "`run_merger.sh` arguments at the budget of the learned rows above, its trained projections replayed on "
           "B. Their alignment's time (weight matching; learned: their whole training) is on the CPU, "
           f"symgraph's alignment on {result.get('device', 'cpu')}."
           + (f" Their run and symgraph's rows ran at the same time, on {par['peer_cpus']} and {par['symgraph_cpus']} "
              f"CPU cores{'' if par.get('pinned') else ' (threads; not pinned)'}." if par else ""), ""]
    cells = []
    by = {(r["row"], r["space"]): r for r in peer}
    f = (lambda r, k="barrier": cell(None if r is None else r.get(k), ".4f"))
    for name in dict.fromkeys(r["row"] for r in peer):
        h, c = _pair(by, name)
        mine = rows.get((name[len("peer_"):].removesuffix("_proj"), "circuits"))
        pi = (h or c)["peer"]
        dm = None if pi.get("mid_loss_their_merger") is None else abs(pi["mid_loss_ours"] - pi["mid_loss_their_merger"])
        cells.append([name, f(h), f(c), f(c, "barrier_theirs"), f(mine), f(mine, "barrier_theirs"),
                      f"{(h or c)['align_seconds']:.2f}", cell((mine or {}).get("align_seconds"), ".2f"),
                      f"{pi['b_loss_rel_change']:.1e}", cell(dm, ".1e")])
    return out + table(["method", "peer, heads", "peer, circuits", "peer, circuits (their barrier)",
                        "symgraph, circuits", "symgraph, circuits (their barrier)", "their alignment s",
                        "symgraph align s", "B loss Δ", "Δ merger"], cells)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["rows"]:
        if r["curve"]:
            xs, ys = zip(*sorted(r["curve"]))
            ax.plot(xs, ys, marker="o", ms=3, label=f"{r['row']} ({r['space']})")
    ax.set_xlabel("λ (1 = parent A)")
    ax.set_ylabel("test loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    save_figure(fig, path, 120)


def write(result: dict, out: Path, log_dirs=()) -> None:
    """``results.json``, ``report.md``, ``curves.png`` and each parent's ``train_log.json`` (from
    ``log_dirs``) as ``train_log_seed{N}.json`` into ``out``, through the one results writer."""
    def figures(rec, d):
        plot(rec, d / "curves.png")
        for src in (Path(x) / "train_log.json" for x in log_dirs):
            if src.is_file():
                shutil.copyfile(src, d / f"train_log_seed{src.parent.name.removeprefix('parent-seed')}.json")
    write_result(out, ".anchor-", result, markdown, figures, command=result.get("command"))

"""Peer: cisco-ai-provenance-kit 1.0.0 (PyPI; Python >= 3.12), its own code, on the provenance
benchmark's cases (:mod:`benchmarks.bench_provenance` ``--peer-cisco``).

The kit runs in a venv of its own (default ``/tmp/symgraph-peer-cisco/venv``, outside the
repository; ``$SYMGRAPH_PEER_CISCO`` or ``--peer-cisco-work`` moves the work directory,
``--peer-cisco-venv`` names an existing venv, ``--peer-cisco-python`` the interpreter that
creates one: ``pip install cisco-ai-provenance-kit==1.0.0``, which brings PyPI's torch, a CUDA
build, run here on the CPU). :func:`score_pairs` runs :mod:`benchmarks.provenance_peer_run`
with that venv's python, one process for all the pairs: the kit's ``ModelProvenanceScanner.compare``
(what ``provenancekit compare --json --no-cache`` runs) on ``save_pretrained`` checkpoints, and
returns per pair its pipeline score, its weight identity score and signals, its decision, or
the reason it could not score the pair (never a made-up number).

Offline: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``, an empty ``HF_HOME``, local
directories only (the kit's loader reads a directory with ``config.json`` from disk and never
calls the hub for it), no feature cache, and sockets refused inside the runner (any attempt is
recorded per pair). ``compare`` never reads the kit's reference database nor downloads its
deep-signal fingerprints (only ``scan`` does), so that step is simply not run.

Tokenizer: the kit's metadata step loads ``AutoTokenizer`` from the model directory and fails
the pair without one. Our tiny models have none, so :func:`save_checkpoint` writes one it
builds offline: a ``tokenizers`` WordLevel tokenizer over the 64 token ids (``t0`` .. ``t63``,
``t0`` as unknown), the same for every model (its tokenizer signals are then 1 on every pair;
the kit reports them and keeps them out of its decision). With 64 tokens and its 64 anchors,
its EAS uses every token's embedding whatever the tokenizer says.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import time
from functools import partial
from pathlib import Path

import numpy as np

from .harness import run_logged
from .provenance import cell

KIT, VERSION = "cisco-ai-provenance-kit", "1.0.0"
NAME = f"{KIT} {VERSION}"
RUNNER = Path(__file__).with_name("provenance_peer_run.py")
THRESHOLD = 0.75  # the kit's SIMILARITY_THRESHOLD: pipeline score > 0.75 is its "High-Confidence Match"
MATCH = ("Confirmed Match", "High-Confidence Match")  # its decisions that say "derived"
SIGNALS = ("eas", "nlf", "lep", "end", "wvc", "tfv", "voa")
HOW = ("ModelProvenanceScanner.compare, what `provenancekit compare --json --no-cache` runs, one process for all "
       "pairs; offline: HF_HUB_OFFLINE=1, local checkpoints, each with a 64-token WordLevel tokenizer written for it")
SCORES = {"cisco": "pipeline score (its decision's score)",
          "cisco_identity": "weight identity score (EAS, NLF, LEP, END, WVC)",
          "cisco_eas": "its EAS signal alone (embedding anchor self-similarity)"}


class PeerError(Exception):
    """A one-line reason the kit could not be run at all (no interpreter, no venv, it crashed)."""


def default_work() -> Path:
    return Path(os.environ.get("SYMGRAPH_PEER_CISCO", "/tmp/symgraph-peer-cisco"))


def find_python() -> str | None:
    """An interpreter >= 3.12 to create the venv with: ``$SYMGRAPH_PEER_PYTHON``, python3.13 or
    python3.12 on the PATH, or pyenv's."""
    cands = [os.environ.get("SYMGRAPH_PEER_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12"),
             *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")), reverse=True)]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def kit_version(python) -> str | None:
    r = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({KIT!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv(venv, python: str | None = None, log=print) -> Path:
    """``venv``'s python with the kit installed, the venv created first when it has no kit
    (``python -m venv``, then ``pip install cisco-ai-provenance-kit==1.0.0``; log beside it)."""
    venv = Path(venv)
    py = venv / "bin" / "python"
    if py.exists() and kit_version(py) == VERSION:
        return py
    python = python or find_python()
    if python is None or not os.access(python, os.X_OK):
        raise PeerError(f"no Python >= 3.12 to create the kit's venv at {venv} ({python or 'none found'}; set "
                        "$SYMGRAPH_PEER_PYTHON or --peer-cisco-python)")
    logf = venv.with_name(venv.name + "-install.log")
    log(f"creating {venv} with {python}: pip install {KIT}=={VERSION} (torch included; log {logf}) ...")
    venv.parent.mkdir(parents=True, exist_ok=True)
    failed = run_logged([[python, "-m", "venv", str(venv)], [str(py), "-m", "pip", "install", f"{KIT}=={VERSION}"]],
                        logf)
    if failed:
        raise PeerError(f"could not create the kit's venv: {' '.join(failed[-2:])} failed (see {logf})")
    if kit_version(py) != VERSION:
        raise PeerError(f"{py} has {KIT} {kit_version(py)}, not {VERSION}")
    return py


def offline_env(work, threads: int = 1) -> dict:
    """The runner's environment: no hub, no GPU, no user site, our ``PYTHONPATH`` dropped."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    home = Path(work) / "hf-home"
    home.mkdir(parents=True, exist_ok=True)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(home), PROVENANCEKIT_CACHE_DIR=str(Path(work) / "kit-cache"),
               PROVENANCEKIT_TRUST_REMOTE_CODE="false", CUDA_VISIBLE_DEVICES="", PYTHONNOUSERSITE="1",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


def write_tokenizer(d, vocab: int) -> None:
    """A WordLevel tokenizer over ``t0`` .. ``t{vocab-1}`` (ids 0 .. vocab-1) into ``d``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(d) / "tokenizer.json"))
    (Path(d) / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "model_max_length": 1 << 20}))


def save_checkpoint(model, d) -> str:
    """``model.save_pretrained(d)`` plus :func:`write_tokenizer`; returns ``d``."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one bar per checkpoint otherwise
    model.save_pretrained(str(d))
    write_tokenizer(d, model.config.vocab_size)
    return str(d)


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def parse_record(rec: dict) -> dict:
    """One runner line (a pair) as a row: the kit's scores, or its error with every score None."""
    out = {"pipeline": None, "identity": None, "mfi_score": None, "mfi_tier": None, "decision": None,
           "tokenizer": None, "signals": {k: None for k in SIGNALS}, "seconds": rec.get("seconds"),
           "warnings": rec.get("warnings", []), "network": rec.get("network", []), "error": rec.get("error")}
    res = rec.get("result")
    if res is None:
        out["error"] = out["error"] or "no result"
        return out
    s = res["scores"]
    out.update(pipeline=_num(s["pipeline_score"]), identity=_num(s["identity_score"]), mfi_score=_num(s["mfi_score"]),
               mfi_tier=s["mfi_tier"], decision=s["provenance_decision"], tokenizer=_num(s["tokenizer_score"]),
               signals={k: _num(res["signals"].get(k)) for k in SIGNALS}, kit_seconds=res.get("time_seconds"))
    if out["pipeline"] is None:
        out["error"] = f"the kit returned no pipeline score ({out['decision']})"
    return out


def parse_output(stdout: str, n: int, why: str = "") -> tuple[dict, list]:
    """The runner's stdout: its versions and ``n`` rows (a pair without a line: ``why``)."""
    versions, got = {}, {}
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "versions" in rec:
            versions = rec["versions"]
        elif "index" in rec:
            got[rec["index"]] = parse_record(rec)
    missing = {"error": f"not scored: {why or 'the kit printed no line for it'}"}
    return versions, [got.get(i, parse_record(missing)) for i in range(n)]


def score_pairs(pairs, python, work=None, threads: int = 1, timeout: float | None = None) -> dict:
    """The kit's comparison of each ``(A dir, B dir)``, run by ``python`` (the kit's venv's) in
    one process: ``{"versions", "pairs": [row per pair], "seconds", "returncode"}``."""
    work = Path(work or default_work())
    job = json.dumps({"pairs": [[str(a), str(b)] for a, b in pairs], "threads": threads})
    t0 = time.perf_counter()
    try:
        p = subprocess.run([str(python), str(RUNNER)], input=job, capture_output=True, text=True,
                           env=offline_env(work, threads), cwd=str(work), timeout=timeout)
        stdout, rc, err = p.stdout, p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        stdout, rc, err = out.decode() if isinstance(out, bytes) else out, None, f"timed out after {timeout} s"
    tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
    # a crash (or a timeout) leaves the pairs it had not printed unscored, with the reason
    versions, rows = parse_output(stdout, len(pairs), f"the kit's runner exited {rc}: {tail}" if rc != 0 else "")
    return {"versions": versions, "pairs": rows, "seconds": time.perf_counter() - t0, "returncode": rc}


def auc(pos, neg) -> float:
    """P(score of a positive > score of a negative), ties counted half (the ROC AUC)."""
    return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))


def peer_table(rows, kinds) -> dict:
    """Per score (:data:`SCORES`): ROC AUC over the scored pairs, highest null, lowest positive
    per kind, TPR with the threshold at the highest null (FPR 0 on this null), pairs not scored;
    and the kit's own decision's FPR / TPR."""
    neg = [r for r in rows if r["label"] == 0]
    pos = [r for r in rows if r["label"] == 1 and r["kind"] != "copy"]
    out = {}
    for key in SCORES:
        n, p = [r[key] for r in neg if r[key] is not None], [r[key] for r in pos if r[key] is not None]
        pm = {k: min((r[key] for r in pos if r["kind"] == k and r[key] is not None), default=None) for k in kinds}
        both = bool(n and p)
        out[key] = {"auc": auc(p, n) if both else None, "null_max": max(n) if n else None, "positive_min": pm,
                    "tpr_at_fpr0": float(np.mean([x > max(n) for x in p])) if both else None,
                    "unscored": len(neg) + len(pos) - len(n) - len(p)}
    said = lambda rs: [r["cisco_detail"]["decision"] in MATCH for r in rs]
    rate = lambda rs: float(np.mean(said(rs))) if rs else None
    out["verdict"] = {"fpr": rate(neg), "false_positives": int(sum(said(neg))), "negatives": len(neg),
                      "tpr": rate(pos),
                      "tpr_by_kind": {k: rate([r for r in pos if r["kind"] == k]) for k in kinds},
                      "decisions": sorted({str(r["cisco_detail"]["decision"]) for r in rows}),
                      "mfi_tiers": sorted({r["cisco_detail"]["mfi_tier"] for r in rows
                                           if r["cisco_detail"]["mfi_tier"] is not None})}
    sig = lambda rs, k: [r["cisco_detail"]["signals"][k] for r in rs if r["cisco_detail"]["signals"][k] is not None]
    used = [k for k in SIGNALS if sig(rows, k)]
    out["signals_used"], out["signals_absent"] = used, [k for k in SIGNALS if k not in used]
    out["signal_means"] = {k: {"null": float(np.mean(sig(neg, k))) if sig(neg, k) else None,
                               "positive": float(np.mean(sig(pos, k))) if sig(pos, k) else None} for k in used}
    out["failures"] = [f"{r['kind']} (A{r['a']}): {r['cisco_detail']['error']}"
                       for r in rows if r["cisco_detail"]["error"]]
    out["network_attempts"] = sum(len(r["cisco_detail"]["network"]) for r in rows)
    return out


def attach(rows, scored: dict) -> None:
    """Each row gets the kit's ``cisco`` (pipeline), ``cisco_identity``, ``cisco_eas`` and
    ``cisco_detail`` (the rest: decision, MFI tier, every signal, its error)."""
    for row, s in zip(rows, scored["pairs"]):
        row["cisco"], row["cisco_identity"], row["cisco_eas"] = s["pipeline"], s["identity"], s["signals"]["eas"]
        row["cisco_detail"] = {k: v for k, v in s.items() if k not in ("pipeline", "identity")}


_f = partial(cell, none="n/a")


def table_rows(p: dict) -> list[str]:
    """The peer's rows of the benchmark's ROC table."""
    out = []
    for key, what in SCORES.items():
        s = p["scores"][key]
        pm = " / ".join(_f(x) for x in s["positive_min"].values())
        out.append(f"| peer: {NAME} (its own code), {what} | {_f(s['auc'])} | {_f(s['null_max'])} | {pm} |")
    return out


def summary(p: dict) -> list[str]:
    """The paragraph under the table: the peer's FPR / TPR, signals, failures, runtime."""
    s, v = p["scores"], p["scores"]["verdict"]
    ver = p.get("versions", {})
    lines = [f"Peer {NAME} ({p['how']}; Python {ver.get('python', '?')}, torch {ver.get('torch', '?')}, "
             f"transformers {ver.get('transformers', '?')}): TPR at FPR 0 (its threshold at the highest null score): "
             f"pipeline {_f(s['cisco']['tpr_at_fpr0'], '.2f')}, identity {_f(s['cisco_identity']['tpr_at_fpr0'], '.2f')}, "
             f"EAS alone {_f(s['cisco_eas']['tpr_at_fpr0'], '.2f')}. "
             f"Its own decision ({' or '.join(MATCH)}: derived): false-positive rate {_f(v['fpr'])} "
             f"({v['false_positives']}/{v['negatives']}), true-positive rate {_f(v['tpr'])} "
             f"({', '.join(k + ' ' + _f(x, '.2f') for k, x in v['tpr_by_kind'].items())}); decisions seen: "
             f"{', '.join(v['decisions'])}; metadata (MFI) tiers: {', '.join(map(str, v['mfi_tiers'])) or 'none'}"
             + (" (tier 1: identical architecture hash, where its pipeline score is the metadata score, 1.0, "
                "whatever the weights)" if 1 in v["mfi_tiers"] else "") + ". Signals it computed on these models, "
             "mean over null / positive pairs: "
             + (", ".join(f"{k} {_f(m['null'], '.2f')} / {_f(m['positive'], '.2f')}"
                          for k, m in s.get("signal_means", {}).items()) or "none")
             + f"; not computed: {', '.join(s['signals_absent']) or 'none'}. "
             f"Network attempts: {s['network_attempts']}. Runtime: {p['seconds']:.0f} s "
             f"({p['seconds_kit']:.0f} s in the kit's process, {p['pairs']} pairs; {p['seconds_save']:.0f} s saving "
             "the checkpoints)."]
    if s["failures"]:
        lines += ["", f"Pairs the kit could not score ({len(s['failures'])}):",
                  *[f"- {f}" for f in s["failures"][:10]]]
    return lines

"""Peer: cisco-ai-provenance-kit 1.0.0 (PyPI; Python >= 3.12), its own code, on the provenance
benchmark's pairs (``python -m benchmarks.bench_provenance --peer-cisco``).

The kit runs in a venv of its own (default ``/tmp/symgraph-peer-cisco/venv``, created with ``pip
install cisco-ai-provenance-kit==1.0.0``); one process of its python runs
:mod:`benchmarks.provenance_peer_run` over all the pairs, saved with ``save_pretrained``: per pair
its pipeline score, weight identity score, signals and decision, or why it could not score the
pair (never a made-up number). Offline: ``HF_HUB_OFFLINE=1``, an empty ``HF_HOME``, no feature
cache, sockets refused; ``compare`` reads no reference database. Its metadata step needs a
tokenizer: :func:`save_checkpoint` writes a WordLevel one over the 64 token ids, the same for every
model (its tokenizer signals, then 1 on every pair, stay out of its decision).
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import tempfile
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
SCORES = {k: f"peer: {NAME} (its own code), {what}" for k, what in (  # the scores' rows of the ROC table
    ("cisco", "pipeline score (its decision's score)"),
    ("cisco_identity", "weight identity score (EAS, NLF, LEP, END, WVC)"),
    ("cisco_eas", "its EAS signal alone (embedding anchor self-similarity)"))}
_f = partial(cell, none="n/a")


class PeerError(Exception):
    """A one-line reason the kit could not be run at all (no interpreter, no venv, it crashed)."""


def default_work() -> Path:
    return Path(os.environ.get("SYMGRAPH_PEER_CISCO", "/tmp/symgraph-peer-cisco"))


def find_python() -> str | None:
    """``$SYMGRAPH_PEER_PYTHON``, python3.13 or python3.12 on the PATH, or pyenv's >= 3.12."""
    cands = [os.environ.get("SYMGRAPH_PEER_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12"),
             *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")), reverse=True)]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def kit_version(python) -> str | None:
    r = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({KIT!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv(venv, python: str | None = None, log=print) -> Path:
    """``venv``'s python with the kit, the venv created first when it has none (log beside it)."""
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
    hf_logging.disable_progress_bar()
    model.save_pretrained(str(d))
    write_tokenizer(d, model.config.vocab_size)
    return str(d)


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def parse_record(rec: dict) -> dict:
    """One runner line (a pair) as a row: the kit's scores, or its error with every score None."""
    res = rec.get("result")
    s, sig = (res["scores"], res["signals"]) if res else ({}, {})
    out = {"pipeline": _num(s.get("pipeline_score")), "identity": _num(s.get("identity_score")),
           "mfi_score": _num(s.get("mfi_score")), "mfi_tier": s.get("mfi_tier"),
           "decision": s.get("provenance_decision"), "tokenizer": _num(s.get("tokenizer_score")),
           "signals": {k: _num(sig.get(k)) for k in SIGNALS}, "seconds": rec.get("seconds"),
           "warnings": rec.get("warnings", []), "network": rec.get("network", []), "error": rec.get("error")}
    if res is None:
        out["error"] = out["error"] or "no result"
        return out
    out["kit_seconds"] = res.get("time_seconds")
    if out["pipeline"] is None:
        out["error"] = f"the kit returned no pipeline score ({out['decision']})"
    return out


def parse_output(stdout: str, n: int, why: str = "") -> tuple[dict, list]:
    """The runner's stdout: its versions and ``n`` rows (a pair without a line: ``why``)."""
    versions, got = {}, {}
    for line in stdout.splitlines():
        rec = json.loads(line) if line.startswith("{") else {}
        if "versions" in rec:
            versions = rec["versions"]
        elif "index" in rec:
            got[rec["index"]] = parse_record(rec)
    missing = {"error": f"not scored: {why or 'the kit printed no line for it'}"}
    return versions, [got.get(i, parse_record(missing)) for i in range(n)]


def score_pairs(pairs, python, work=None, threads: int = 1, timeout: float | None = None) -> dict:
    """The kit's comparison of each ``(A dir, B dir)`` by ``python`` (its venv's), one process:
    ``{"versions", "pairs": [row per pair], "seconds", "returncode"}``. A crash leaves the pairs
    not printed yet unscored, with the reason."""
    work = Path(work or default_work())
    job = json.dumps({"pairs": [[str(a), str(b)] for a, b in pairs], "threads": threads})
    t0 = time.perf_counter()
    p = subprocess.run([str(python), str(RUNNER)], input=job, capture_output=True, text=True,
                       env=offline_env(work, threads), cwd=str(work), timeout=timeout)
    tail = " | ".join(p.stderr.strip().splitlines()[-3:])[-400:]
    why = f"the kit's runner exited {p.returncode}: {tail}" if p.returncode != 0 else ""
    versions, rows = parse_output(p.stdout, len(pairs), why)
    return {"versions": versions, "pairs": rows, "seconds": time.perf_counter() - t0, "returncode": p.returncode}


def auc(pos, neg) -> float:
    """P(score of a positive > score of a negative), ties counted half (the ROC AUC)."""
    return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))


def roc(rows, key, kinds) -> dict:
    """Score ``key`` over the pairs it scored (null: label 0; positives: label 1, exact copies
    aside): ROC AUC, the highest null, the lowest positive per kind, the TPR with the threshold
    at the highest null (FPR 0 on this null), and how many pairs it did not score."""
    neg = [r for r in rows if r["label"] == 0]
    pos = [r for r in rows if r["label"] == 1 and r["kind"] != "copy"]
    n, p = [r[key] for r in neg if r[key] is not None], [r[key] for r in pos if r[key] is not None]
    both = bool(n and p)
    return {"auc": auc(p, n) if both else None, "null_max": max(n) if n else None,
            "positive_min": {k: min((r[key] for r in pos if r["kind"] == k and r[key] is not None), default=None)
                             for k in kinds},
            "tpr_at_fpr0": float(np.mean([x > max(n) for x in p])) if both else None,
            "unscored": len(neg) + len(pos) - len(n) - len(p)}


def roc_rows(scores: dict, names: dict) -> list:
    """Rows of the benchmark's ROC table: per score of ``names``, its name, AUC, highest null and
    lowest positives."""
    return [[name, _f(s["auc"]), _f(s["null_max"]), " / ".join(_f(x) for x in s["positive_min"].values())]
            for key, name in names.items() for s in [scores[key]]]


def peer_table(rows, kinds) -> dict:
    """:func:`roc` per score of :data:`SCORES`; the kit's own decision's FPR / TPR, the signals it
    computed, its failures and network attempts."""
    out = {key: roc(rows, key, kinds) for key in SCORES}
    neg = [r for r in rows if r["label"] == 0]
    pos = [r for r in rows if r["label"] == 1 and r["kind"] != "copy"]
    said = lambda rs: [r["cisco_detail"]["decision"] in MATCH for r in rs]  # noqa: E731
    rate = lambda rs: float(np.mean(said(rs))) if rs else None  # noqa: E731
    out["verdict"] = {"fpr": rate(neg), "false_positives": int(sum(said(neg))), "negatives": len(neg),
                      "tpr": rate(pos), "tpr_by_kind": {k: rate([r for r in pos if r["kind"] == k]) for k in kinds},
                      "decisions": sorted({str(r["cisco_detail"]["decision"]) for r in rows}),
                      "mfi_tiers": sorted({r["cisco_detail"]["mfi_tier"] for r in rows
                                           if r["cisco_detail"]["mfi_tier"] is not None})}
    sig = lambda rs, k: [r["cisco_detail"]["signals"][k] for r in rs  # noqa: E731
                         if r["cisco_detail"]["signals"][k] is not None]
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


def run(models, pairs, rows, kinds, python, work=None, threads: int = 1) -> dict:
    """The kit on the pairs ``[(A's index in models, B)]``, saved under ``work`` while it runs;
    ``rows`` get its scores (:func:`attach`). The peer's results, :func:`peer_table` included."""
    work = Path(work or default_work())
    work.mkdir(parents=True, exist_ok=True)
    cdir = Path(tempfile.mkdtemp(prefix="cases-", dir=work))
    t0 = time.perf_counter()
    try:
        dirs = []
        for n, (i, B) in enumerate(pairs):
            if not (cdir / f"a{i}").exists():
                save_checkpoint(models[i], cdir / f"a{i}")
            dirs.append((cdir / f"a{i}", save_checkpoint(B, cdir / f"b{n}")))
        t_save = time.perf_counter() - t0
        scored = score_pairs(dirs, python, work, threads=threads)
    finally:
        shutil.rmtree(cdir, ignore_errors=True)
    attach(rows, scored)
    return {"name": NAME, "how": HOW, "python": str(python), "versions": scored["versions"], "pairs": len(dirs),
            "returncode": scored["returncode"], "scores": peer_table(rows, kinds), "seconds_kit": scored["seconds"],
            "seconds_save": t_save, "seconds": time.perf_counter() - t0}


def summary(p: dict) -> list[str]:
    """The paragraph under the table: the peer's FPR / TPR, signals, failures, runtime."""
    s, v = p["scores"], p["scores"]["verdict"]
    ver = p.get("versions", {})
    tiers = ", ".join(map(str, v["mfi_tiers"])) or "none"
    if 1 in v["mfi_tiers"]:
        tiers += (" (tier 1: identical architecture hash, where its pipeline score is the metadata score, 1.0, "
                  "whatever the weights)")
    means = ", ".join(f"{k} {_f(m['null'], '.2f')} / {_f(m['positive'], '.2f')}" for k, m in s["signal_means"].items())
    kinds = ", ".join(k + " " + _f(x, ".2f") for k, x in v["tpr_by_kind"].items())
    lines = [f"Peer {NAME} ({p['how']}; Python {ver.get('python', '?')}, torch {ver.get('torch', '?')}, "
             f"transformers {ver.get('transformers', '?')}): TPR at FPR 0 (its threshold at the highest null score): "
             f"pipeline {_f(s['cisco']['tpr_at_fpr0'], '.2f')}, identity "
             f"{_f(s['cisco_identity']['tpr_at_fpr0'], '.2f')}, EAS alone {_f(s['cisco_eas']['tpr_at_fpr0'], '.2f')}. "
             f"Its own decision ({' or '.join(MATCH)}: derived): false-positive rate {_f(v['fpr'])} "
             f"({v['false_positives']}/{v['negatives']}), true-positive rate {_f(v['tpr'])} "
             f"({kinds}); decisions seen: {', '.join(v['decisions'])}; metadata (MFI) tiers: {tiers}. Signals it "
             f"computed on these models, mean over null / positive pairs: {means or 'none'}; not computed: "
             f"{', '.join(s['signals_absent']) or 'none'}. "
             f"Network attempts: {s['network_attempts']}. Runtime: {p['seconds']:.0f} s "
             f"({p['seconds_kit']:.0f} s in the kit's process, {p['pairs']} pairs; {p['seconds_save']:.0f} s saving "
             "the checkpoints)."]
    if s["failures"]:
        lines += ["", f"Pairs the kit could not score ({len(s['failures'])}):",
                  *[f"- {f}" for f in s["failures"][:10]]]
    return lines

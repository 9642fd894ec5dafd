"""Theus et al.'s own released code on our parents: their source, their venv, the glue, the rows.

Their code (antoniohonsell/Generalized-LMC-for-Transformers at 6b207cc) is never copied into this
project: ``python -m benchmarks.anchor.peer fetch [--work DIR] [--mirror PATH]`` clones it into
``DIR/Generalized-LMC-for-Transformers`` and ``... venv [--work DIR]`` makes ``DIR/peer-venv``
with their pinned ``transformers==4.50.1`` and what their merger imports (:data:`PEER_PINS`;
``DIR``: ``$SYMGRAPH_ANCHOR_PEER``, else ``<anchor cache>/peer``). Without a venv, any interpreter
with their pins on a ``PYTHONPATH`` runs it (``--peer-python``/``--peer-pythonpath``; the
transformers it imported is checked); a source copied without ``.git`` is recognised by the
digests of the files the glue imports (:data:`PEER_SHA256`).

:func:`peer_rows` runs their weight matching (``GPTMerger`` under their ``eval.py`` seed, through
the glue :mod:`benchmarks.anchor.peer_run`) on the two saved parents for each variant of
:data:`VARIANTS` and evaluates every exported aligned B against their absorbed A with *our*
evaluation (:func:`symgraph.interpolate`, the anchor's test loss): in circuit space (their space;
equal to their merger's interpolation, checked at λ = 0.5 on a batch) and with the heads' factors
interpolated (``heads``: their absorbed form, LayerNorm → RMSNorm, gains 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import data as D
from ..harness import run_logged

PEER_URL = "https://github.com/antoniohonsell/Generalized-LMC-for-Transformers"
PEER_COMMIT = "6b207cc4ed21ae363d70f9e7875e14385996588e"
PEER_NAME = "Generalized-LMC-for-Transformers"
PEER_LABEL = "peer code (Theus et al. 6b207cc)"
#: Their ``requirements.txt`` pins transformers only; the rest are the versions this recipe was run with.
PEER_TORCH = "torch==2.13.0"  # the local CPU wheel; installed first so pip does not pull CUDA
PEER_PINS = ("transformers==4.50.1", "einops==0.8.2", "POT==0.9.7.post1", "scipy==1.17.1",
             "numpy==2.4.6", "safetensors==0.8.0", "accelerate==1.6.0")  # accelerate: their Trainer (learned)
RUNNER = Path(__file__).resolve().with_name("peer_run.py")
#: the first 16 hex digits of the sha256 of each file the glue imports, at :data:`PEER_COMMIT`
PEER_SHA256 = {"merger.py": "e1086b2ff2611fa3", "weight_matching.py": "e03eaa557f4c59e3",
               "utils.py": "372ce868384b0bed", "enums.py": "90381919bb73ce8d"}
PEER_TRANSFORMERS = "4.50.1"  # their requirements.txt
#: variant -> (permutations_only, seen-token rows only); each gives a row without their
#: merger's random near-identity projection and, where it is not the identity, one with it (``_proj``)
VARIANTS = {"weights": (False, False), "weights_seen": (False, True),
            "weights_perm": (True, False), "weights_perm_seen": (True, True)}
#: their learned matching (``train_merger.py``, seen-token rows): variant -> permutations_only
LEARNED = {"learned": False, "learned_perm": True}


class PeerError(Exception):
    """A one-line reason the peer's code could not run (no source, no venv, the glue failed)."""


def default_work() -> Path:
    """``$SYMGRAPH_ANCHOR_PEER``, else ``<anchor cache>/peer``."""
    env = os.environ.get("SYMGRAPH_ANCHOR_PEER")
    return Path(env) if env else D.default_cache() / "peer"


def source_dir(work: str | os.PathLike) -> Path:
    return Path(work) / PEER_NAME


def venv_dir(work: str | os.PathLike) -> Path:
    return Path(work) / "peer-venv"


def python_of(venv: str | os.PathLike) -> Path:
    return Path(venv) / "bin" / "python"


def check_source(src) -> str | None:
    """Their checkout's commit; for a copy without ``.git``, :data:`PEER_COMMIT` when the files the
    glue imports are that commit's (:data:`PEER_SHA256`), else None. PeerError when one is missing."""
    src = Path(src)
    missing = [f for f in PEER_SHA256 if not (src / f).is_file()]
    if missing:
        raise PeerError(f"no peer source at {src} (missing {', '.join(missing)}); fetch it with "
                        f"`python -m benchmarks.anchor.peer fetch --work DIR`")
    if (src / ".git").exists():
        r = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    same = all(hashlib.sha256((src / f).read_bytes()).hexdigest()[:16] == h for f, h in PEER_SHA256.items())
    return PEER_COMMIT if same else None


def fetch(work, mirror: str | None = None) -> Path:
    """``git clone`` their repository (or a local ``mirror`` of it) into ``work`` and check out
    :data:`PEER_COMMIT`; a checkout already there is only checked out again."""
    src = source_dir(work)
    src.parent.mkdir(parents=True, exist_ok=True)
    if not (src / ".git").exists():
        subprocess.run(["git", "clone", "-q", mirror or PEER_URL, str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "checkout", "-q", PEER_COMMIT], check=True)
    if check_source(src) != PEER_COMMIT:
        raise PeerError(f"{src} is not at {PEER_COMMIT}")
    return src


def ensure_venv(venv) -> Path:
    """The venv's python, the venv created first if absent (their pins; log in ``<venv>-install.log``)."""
    venv = Path(venv)
    py = python_of(venv)
    if py.exists():
        return py
    print(f"creating {venv} ({PEER_TORCH}, then {' '.join(PEER_PINS)}) ...", flush=True)
    logf = venv.with_name(venv.name + "-install.log")
    pip = [str(py), "-m", "pip", "install", "-q"]
    venv.parent.mkdir(parents=True, exist_ok=True)
    failed = run_logged([[sys.executable, "-m", "venv", "--clear", str(venv)], pip + [PEER_TORCH],
                         pip + list(PEER_PINS)], logf)
    if failed:
        raise PeerError(f"could not create the peer venv: {failed[-1]} failed (see {logf})")
    return py


def start_glue(python, src, model_a, model_b, out, variants=tuple(VARIANTS), token_freqs=None,
               check_ids=None, seed: int = 42, threads: int | None = None, pythonpath: str | None = None,
               cpus=None, learned=(), learn: dict | None = None) -> dict:
    """Start :mod:`.peer_run` with the peer's ``python`` (``pythonpath``: its PYTHONPATH) on two
    ``save_pretrained`` parents, in the background (``cpus``: the CPU cores it may use;
    ``learned``: variants of :data:`LEARNED` their ``train_merger.py`` trains, with ``learn``: the
    token tensors ``train_ids``/``val_ids``, ``tokenizer`` and their budget ``batch_size``,
    ``epochs``, ``max_steps``); :func:`finish_glue` waits for it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"src": str(src), "model_a": str(model_a), "model_b": str(model_b), "out": str(out),
            "variants": [{"name": v, "permutations_only": VARIANTS[v][0], "seen": VARIANTS[v][1]} for v in variants],
            "token_freqs": str(token_freqs) if token_freqs else None,
            "check_ids": str(check_ids) if check_ids else None, "seed": seed,
            "learned": [{"name": v, "permutations_only": LEARNED[v]} for v in learned], "learn": learn,
            "threads": threads or (len(cpus) if cpus else torch.get_num_threads())}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", PYTHONPATH=str(pythonpath or ""))
    logs = [open(out / "glue.stdout", "w"), open(out / "glue.stderr", "w")]  # files: a full pipe would block it
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # the caller checked it can
    proc = subprocess.Popen([str(python), str(RUNNER), str(out / "spec.json")], stdout=logs[0], stderr=logs[1],
                            env=env, preexec_fn=pin)
    return {"proc": proc, "logs": logs, "out": out, "t0": time.perf_counter(), "python": str(python),
            "pythonpath": pythonpath, "threads": spec["threads"], "cpus": len(cpus) if cpus else None}


def finish_glue(job: dict) -> dict:
    """Wait for a :func:`start_glue` run; its JSON, checked to have run their transformers."""
    rc = job["proc"].wait()
    for f in job["logs"]:
        f.close()
    if rc != 0:
        tail = ((job["out"] / "glue.stderr").read_text().strip().splitlines() or ["(no output)"])[-1]
        raise PeerError(f"the peer glue exited {rc}: {tail}")
    res = json.loads((job["out"] / "glue.stdout").read_text().strip().splitlines()[-1])
    res.update({k: job[k] for k in ("python", "pythonpath", "threads", "cpus")},
               seconds_subprocess=time.perf_counter() - job["t0"])
    if res["versions"]["transformers"] != PEER_TRANSFORMERS:
        raise PeerError(f"the peer glue imported transformers {res['versions']['transformers']}, not their "
                        f"{PEER_TRANSFORMERS} ({job['python']}, PYTHONPATH={job['pythonpath'] or ''!r})")
    return res


def run_glue(*args, **kwargs) -> dict:
    """:func:`start_glue`, then :func:`finish_glue`."""
    return finish_glue(start_glue(*args, **kwargs))


class RMSNorm(torch.nn.Module):
    """Their ``utils.RMSNorm`` (``g · x / sqrt(mean(x²) + ε) + b``), the norm of their absorbed form."""

    def __init__(self, weight, bias, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.bias = torch.nn.Parameter(bias.detach().clone())
        self.eps = eps

    def forward(self, x):
        return self.weight * (x / x.pow(2).mean(dim=-1, keepdim=True).add(self.eps).sqrt()) + self.bias


def load_exported(path):
    """A checkpoint the glue wrote, as the model it stands for: GPT-2 with their RMSNorm."""
    from transformers import GPT2LMHeadModel
    m = GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    for mod in list(m.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.LayerNorm):
                setattr(mod, name, RMSNorm(child.weight, child.bias, child.eps))
    m.config.use_cache = False  # evaluated whole, as the parents (benchmarks.anchor.table)
    return m


def barrier_theirs(curve) -> float:
    """Theus et al.'s barrier: ``max_λ L(λ) − (λ·L_A + (1−λ)·L_B)`` (A at λ = 1)."""
    curve = sorted(curve)
    lb, la = curve[0][1], curve[-1][1]
    return max(l - (lam * la + (1 - lam) * lb) for lam, l in curve)


def start_peer(dir_a, dir_b, B, *, test, seen, src, python, work, variants=tuple(VARIANTS),
               pythonpath: str | None = None, cpus=None, learned=(), learn: dict | None = None) -> dict:
    """Start their weight matching on the parents saved in ``dir_a``/``dir_b`` in the background, on
    the CPU as their code runs (``B``: parent B loaded; ``test``: ``[n, L]`` ids; ``seen``: training
    ids, their token counts; ``learned``/``learn``: their learned matching too, :func:`start_glue`,
    with ``[n, L]`` tensors saved here for their loop); :func:`peer_rows` evaluates what it gives."""
    out = Path(work) / "aligned"
    out.mkdir(parents=True, exist_ok=True)
    vocab = B.get_output_embeddings().weight.shape[0]
    torch.save(torch.bincount(seen.reshape(-1).long(), minlength=vocab).cpu(), out / "token_freqs.pt")
    check = test[:4].clone()
    torch.save(check.cpu(), out / "check_ids.pt")
    if learned:
        learn = dict(learn, tokenizer=str(learn["tokenizer"]))
        for k in ("train_ids", "val_ids"):
            torch.save(learn[k].cpu(), out / f"{k}.pt")
            learn[k] = str(out / f"{k}.pt")
    return {"glue": start_glue(python, src, dir_a, dir_b, out / "models", variants, out / "token_freqs.pt",
                               out / "check_ids.pt", pythonpath=pythonpath, cpus=cpus, learned=learned,
                               learn=learn if learned else None),
            "commit": check_source(src), "check": check}


def peer_rows(job, B, *, test, lambdas, spaces=("heads", "circuits"), eval_bs: int = 8) -> list[dict]:
    """Rows of their weight matching and learned matching (a :func:`start_peer` job, waited for
    here), evaluated as symgraph's rows are, on B's device (their models moved there)."""
    import symgraph
    res = finish_glue(job["glue"])
    check = job["check"]
    dev = next(B.parameters()).device
    A = load_exported(res["A"]).to(dev)
    loss = lambda m: D.test_loss(m, check, batch_size=len(check))  # noqa: E731
    b_loss = loss(B)
    base = {"commit": job["commit"], "align_device": "cpu", **{k: res[k] for k in (
        "versions", "python", "pythonpath", "threads", "cpus")}}
    rows = []

    def add(name, path, seconds, info, learned=None):
        Bal = load_exported(path).to(dev)
        mid = float(symgraph.interpolate(A, Bal, [0.5], loss, attention="circuits")[0][1])
        info = {**base, **info, "b_loss_rel_change": abs(loss(Bal) - b_loss) / b_loss, "mid_loss_ours": mid}
        for space in spaces:
            t0 = time.perf_counter()
            curve = symgraph.interpolate(A, Bal, lambdas, lambda m: D.test_loss(m, test, batch_size=eval_bs),
                                         attention=space)
            rows.append({"row": name, "space": space, "by": "peer", "device": str(dev),
                         "barrier": symgraph.loss_barrier(curve), "barrier_theirs": barrier_theirs(curve),
                         "curve": curve, "align_seconds": seconds, "seconds": seconds + time.perf_counter() - t0,
                         "refine_steps": (learned or {}).get("steps") or 0, "refined": learned, "note": None,
                         "peer": info})
            print(f"{name:24s} {space:8s} barrier {rows[-1]['barrier']:.4f} (theirs {rows[-1]['barrier_theirs']:.4f}); "
                  f"their alignment {seconds:.1f} s", flush=True)
    for v in res["variants"]:
        for kind in ("noproj", "proj"):
            if kind == "proj" and v["projection_is_identity"]:
                continue  # permutations only: their projection rounds to the identity
            add("peer_" + v["name"] + ("_proj" if kind == "proj" else ""), v["dirs"][kind],
                v["seconds_weight_matching"],
                {"permutations_only": v["permutations_only"], "seen_rows": v["seen"], "projection": kind == "proj",
                 "projection_residual_dist": v["projection_residual_dist"] if kind == "proj" else 0.0,
                 "replay_max_abs": v["replay_max_abs"], "mid_loss_their_merger": v.get("merger_mid_loss", {}).get(kind),
                 "merger_seconds": v["seconds_merger"]})
    for v in res.get("learned") or []:  # their train_merger.py: seen rows, their trained projection
        add("peer_" + v["name"], v["dir"], v["seconds"],
            {"permutations_only": v["permutations_only"], "seen_rows": True, "projection": True, "learned": True,
             "mid_loss_their_merger": None, "merger_seconds": v["seconds"]},
            learned={k: v[k] for k in ("steps", "best_checkpoint", "evals", "batch_size", "epochs", "max_steps")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.anchor.peer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"clone their repository at {PEER_COMMIT[:7]} into WORK")
    f.add_argument("--work", default=None, help="work directory (default $SYMGRAPH_ANCHOR_PEER or <cache>/peer)")
    f.add_argument("--mirror", default=None, help="clone from this local git mirror instead of GitHub")
    sub.add_parser("venv", help="create WORK/peer-venv with their pins").add_argument("--work", default=None)
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else default_work()
    try:
        print(fetch(work, a.mirror) if a.cmd == "fetch" else ensure_venv(venv_dir(work)))
    except (PeerError, subprocess.CalledProcessError) as e:
        print(f"benchmarks.anchor.peer: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed papers' released code beside our reimplementations, on the suite's models:
``python -m benchmarks seeds`` (``--setup``: make the authors' venvs, pinned packages).

For each seed paper of :data:`SEEDS`: the suite's pair of that architecture (trained, or loaded
from the suite's cache, by :func:`benchmarks.train.train_model`), plain averaging, our
reimplementation (:mod:`benchmarks.methods`), symgraph's activation matching, and the authors'
code at its pinned commit, run by its own venv's Python through a thin driver. The same alignment
batches (the training split's first ``--align-batches``) go to both sides. Every merged model is
the λ = 0.5 model, scored the same way: the suite's held-out loss and metric on the whole held-out
split, and the midpoint gap ``L(mid) − ½(L_A + L_B)``. Where the authors' code cannot run, the
row says why (the last line it printed).

The authors' code lives in ``ROOT/seeds-code/NAME`` (an unpacked checkout whose git tree id must
equal the pinned commit's before anything in it runs), their venv in ``ROOT/seeds-venv-NAME``;
``ROOT``: ``--root``, else ``$SYMGRAPH_SEEDS_ROOT``, else the directory above the repository.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..provenance import REPO_ROOT, command_line, commit_info, git_state, log, matmul_rates, table, write_result
from . import exchange

HERE = Path(__file__).resolve().parent
RESULTS = REPO_ROOT / "benchmarks" / "results" / "seeds"


@dataclass(frozen=True)
class Seed:
    """One seed paper's released code: where it is, what it runs on, and in which venv."""
    name: str
    paper: str
    repo: str
    commit: str
    tree: str
    arch: str
    ours: str
    driver: str
    requirements: tuple
    pins: str
    how: str
    pip_options: tuple = ()  # of the venv's install (``--no-deps``: every package is pinned)
    also: tuple = ()  # our further rows beside this seed's (after OURS)


SEEDS = {
    "imfeld": Seed(
        "imfeld", "Imfeld et al. 2024, Transformer Fusion with Optimal Transport", "graldij/transformer-fusion",
        "204ae23a3f71419319442454dc05693c110b0456", "7170252e5ec383835e0d9386d7168354e081b83a",
        "vit", "imfeld2024", "drive_imfeld.py",
        ("torch==2.13.0", "numpy==1.26.4", "POT==0.9.0", "transformers==4.27.4", "tokenizers==0.13.3",
         "PyYAML==6.0.1", "matplotlib==3.8.3", "scipy==1.12.0", "safetensors==0.8.0"),
        "their requirements.txt pins, except torch 2.2.1 -> 2.13.0 (the CPU build this machine has; 2.2.1 "
        "on the package index is the CUDA build) and POT 0.8.2 -> 0.9.0 (0.8.2 ships no Python 3.11 wheel "
        "and its source build fails with today's setuptools); torchvision, datasets and scikit-learn are "
        "not installed (only their CIFAR-10 loading and Trainer evaluation use them)",
        "their main.py's steps for their published experiments/fuse_hf_vit_cifar10.yaml (activations, "
        "Sinkhorn 0.08, residual policy 'mean', Q/K 'separate', every layer fused), our A as their anchor "
        "model_1; changed: fusion.acts.num_samples = the number of alignment images (theirs 200); their "
        "seq_filter window_6 applies to 65-token sequences only, so on our 17-token ViT every token counts"),
    "verma": Seed(
        "verma", "Verma & Elbayad 2024, Merging Text Transformer Models from Different Initializations",
        "nverma1/merging-text-transformers", "0a03fa0336f35790481b843896f8ec32b860d069",
        "50375d3377cb95d4251288585c09679cffd2486e", "bert", "verma2024", "drive_verma.py",
        ("torch==2.13.0", "numpy==1.26.4", "transformers==4.38.2", "networkx==3.2.1", "scipy==1.12.0",
         "matplotlib==3.8.3", "pytorch-nlp==0.5.0", "tqdm==4.70.1", "safetensors==0.8.0"),
        "their requirements.txt pins no versions: transformers, numpy, scipy, networkx and matplotlib "
        "of their code's time (March 2024), torch 2.13.0 (this machine's CPU build); datasets is not "
        "installed (only their data loading uses it)",
        "their merge_bert_classifiers.py with --task mlm --bsz 8 --special-toks --permute-heads --no-absval "
        "--merge-type all --res-type all (configs/bert_books.py: covariance); their graph builder's 12 layers "
        "and 12 heads set to our model's; the λ = 0.5 model built as their graphing_mlm.py --unmerge builds "
        "it (an untied decoder, their unmerge matrix applied to B's)"),
    "zhang": Seed(
        "zhang", "Zhang et al. 2025, Beyond the Permutation Symmetry of Transformers: The Role of Rotation for "
        "Model Fusion", "zhengzaiyi/RotationSymmetry", "b89d081429d6e6351f3449d60df5562dfa146664",
        "a49c192047b7e6ccecc6d2423ffde2d67e62b51d", "bert", "zhang2025", "drive_zhang.py",
        ("torch==2.13.0", "numpy==1.24.2", "scipy==1.10.1", "POT==0.9.0", "PyYAML==6.0", "transformers==4.20.1",
         "huggingface-hub==0.13.0", "packaging==23.0", "regex==2022.10.31", "requests==2.28.2", "tqdm==4.65.0",
         "filelock==3.9.0", "urllib3==1.26.14", "certifi==2022.12.7", "idna==3.4", "charset-normalizer==3.1.0",
         "fsspec==2023.3.0", "typing_extensions==4.16.0", "sympy==1.14.0", "mpmath==1.3.0", "networkx==3.6.1",
         "Jinja2==3.1.6", "MarkupSafe==3.0.4", "setuptools==84.2.1", "safetensors==0.8.0"),
        "their requirements.txt pins (installed with pip --no-deps, every package listed), except torch 1.13.1 "
        "-> 2.13.0 (the CPU build this machine has; 1.13.1 ships no Python 3.11 CPU wheel here), POT 0.8.2 -> "
        "0.9.0 (0.8.2 ships no Python 3.11 wheel and its source build fails with today's setuptools), "
        "typing_extensions 4.5.0 -> 4.16.0 (torch 2.13 needs >= 4.10) and torch's own dependencies (sympy, "
        "mpmath, networkx, Jinja2, MarkupSafe, setuptools) added; tokenizers 0.12.1 is not installed (it ships no "
        "Python 3.11 wheel and its source build needs Rust; only their tokenizer loading uses it, and transformers "
        "4.20.1 checks its version only where it is installed), nor datasets, pandas, pyarrow, scikit-learn "
        "and the aiohttp stack (their data loading and metrics only)",
        "their PermutationInvarianMerger (src/model_merge/pi_merger.py, merger.algo 'pi', data-free) as their "
        "merge_to_global runs it: match_ffns (Permute_IO), match_attentions (Chunk_SVD_QK, Chunk_SVD_VO), "
        "avg_merge; configured by src/configs/defaults.yaml's merger block and their published "
        "src/configs/exps/roberta-base/roberta-pi.yaml, whose module patterns name BERT's modules as they "
        "are (RoBERTa is BERT's code; each pattern matches one module per layer, checked); our B the local "
        "model, our A the anchor (their nearest-to-the-average rule is a tie for two models)",
        pip_options=("--no-deps",), also=("zhang2025_rescale", "symgraph_weights")),
}
#: Our rows beside each seed's: plain averaging, the reimplementation, symgraph's activation matching.
OURS = ("vanilla", None, "symgraph_activations")
#: Rows of the first batch whose logits both sides compare (the exchange check).
REFERENCE_ROWS = 8


def root_dir(given=None) -> Path:
    return Path(given or os.environ.get("SYMGRAPH_SEEDS_ROOT") or REPO_ROOT.parent).resolve()


def places(seed: Seed, root: Path) -> tuple[Path, Path]:
    """(their code, their venv's python) under ``root``."""
    return root / "seeds-code" / seed.repo.split("/")[1], root / f"seeds-venv-{seed.name}" / "bin" / "python"


def setup(root: Path, names) -> int:
    """Make each seed's venv with its pinned packages; say where its code goes."""
    for name in names:
        s = SEEDS[name]
        code, python = places(s, root)
        venv = python.parent.parent
        if not python.is_file():
            subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *s.pip_options, *s.requirements], check=True)
        log(f"{name}: venv {venv} ready; code: git clone https://github.com/{s.repo} {code} && "
            f"git -C {code} checkout {s.commit}")
    return 0


def _score(m, arch: str, parents: dict) -> dict:
    from .. import evaluate
    loss = evaluate.eval_loss(m, arch)
    return {"loss_mid": loss, "gap_mid": loss - 0.5 * (parents["loss_a"] + parents["loss_b"]),
            "metric_mid": evaluate.eval_metric(m, arch)}


def ours(seed: Seed, pair, parents: dict) -> list[dict]:
    """Our rows for ``seed``'s pair (see :data:`OURS`)."""
    from .. import methods
    from ..suite import copy_mid
    rows = []
    for name in (*(m or seed.ours for m in OURS), *seed.also):
        t = time.perf_counter()
        out = methods.METHODS[name][0](pair)
        seconds = time.perf_counter() - t
        mid = out.merged if out.merged is not None else copy_mid(pair.a, out.b_aligned)
        rows.append({"arch": seed.arch, "method": name, "code": "ours (benchmarks/methods.py)",
                     "seconds": seconds, **_score(mid, seed.arch, parents)})
        log(f"  {seed.arch} {name:<22} L(mid) {rows[-1]['loss_mid']:.4f}  {seconds:.1f}s")
    return rows


def theirs(seed: Seed, root: Path, a, b, batches, parents: dict, timeout: float) -> tuple[list, dict]:
    """The authors' rows for ``seed`` (their merged model, then each variant their driver names),
    or one row saying why there is none; and what their run reported."""
    from .. import evaluate
    code, python = places(seed, root)
    row = {"arch": seed.arch, "method": seed.ours, "code": f"authors' ({seed.repo}@{seed.commit[:7]})"}
    key = evaluate.input_key(seed.arch)
    data = {key: torch.cat([x[key] for x in batches]), "labels": torch.cat([x["labels"] for x in batches])}
    try:
        if not code.is_dir() or not python.is_file():
            raise exchange.Failed(f"not set up: no {'code' if not code.is_dir() else 'venv'} under --root "
                                  f"(python -m benchmarks seeds --setup)")
        tree = exchange.code_tree(code)
        if tree != seed.tree:
            raise exchange.Failed(f"code tree {tree} is not commit {seed.commit[:7]}'s ({seed.tree})")
        with tempfile.TemporaryDirectory(prefix="seeds-job-") as tmp, torch.no_grad():
            ref = {n: evaluate.model_logits(m, seed.arch, {key: data[key][:REFERENCE_ROWS]}).contiguous()
                   for n, m in (("a", a), ("b", b))}
            job = exchange.write_job(Path(tmp), {"a": a, "b": b}, data, ref,
                                     {"seed": seed.name, "reference_rows": REFERENCE_ROWS})
            t = time.perf_counter()
            exchange.run_driver(python, HERE / seed.driver, code, job, timeout)
            wall = time.perf_counter() - t
            info, state, variants = exchange.read_output(job)
        rows = []
        for name, st in [(None, state), *variants.items()]:
            merged = exchange.load_merged(a, st, info.get("untied"))
            seconds = info.get("variant_seconds", {}).get(name, info["seconds"])
            rows.append({**row, "method": seed.ours + (f" ({name})" if name else ""), "seconds": seconds,
                         "driver_wall_seconds": wall, **_score(merged, seed.arch, parents)})
            log(f"  {seed.arch} {rows[-1]['method']} (authors') L(mid) {rows[-1]['loss_mid']:.4f}")
        return rows, {"status": "ran", **info}
    except (exchange.Failed, ValueError) as e:
        why = str(e).replace(str(root), "<root>")
        log(f"  {seed.arch} {seed.ours} (authors') could not run: {why}")
        return [{**row, "error": why}], {"status": "could not run", "error": why}


def run_seed(seed: Seed, args, root: Path) -> tuple[list, dict]:
    """Every row of one seed paper's comparison, on the suite's first pair of its architecture."""
    import symgraph

    from .. import evaluate, methods, train
    sa, sb = args.seeds
    a, b = (train.train_model(seed.arch, s, args.size) for s in (sa, sb))
    batches = evaluate.eval_batches(seed.arch, "train", args.align_batches)
    data = [(x[evaluate.input_key(seed.arch)],) for x in batches]
    pair = methods.Pair(seed.arch, a, b, data, symgraph.analyze(a, data[0]), symgraph.analyze(b, data[0]))
    parents = {"loss_a": evaluate.eval_loss(a, seed.arch), "loss_b": evaluate.eval_loss(b, seed.arch),
               "metric_a": evaluate.eval_metric(a, seed.arch), "metric_b": evaluate.eval_metric(b, seed.arch)}
    rows = ours(seed, pair, parents)
    more, info = theirs(seed, root, a, b, batches, parents, args.timeout)
    rows += more
    for r in rows:
        r.update(pair=[sa, sb], size=args.size, metric_name=evaluate.metric_name(seed.arch), **parents)
    return rows, {"paper": seed.paper, "repo": seed.repo, "commit": seed.commit, "tree": seed.tree,
                  "driver": f"benchmarks/seeds/{seed.driver}", "requirements": list(seed.requirements),
                  "pins": seed.pins, "how": seed.how, **info}


def markdown(rec: dict) -> str:
    st = rec["settings"]
    lines = ["# The seed papers' own code beside our reimplementations", "",
             f"`{rec['command']}` at commit `{rec['commit']}` (symgraph `{rec['symgraph']}`): the suite's "
             f"`{st['size']}` pairs (seeds {st['seeds']}), {st['align_batches']} alignment batches of "
             "the training split given to every method, every merged model the λ = 0.5 model, scored on "
             "the whole held-out split. gap = L(mid) − ½(L_A + L_B) (lower is better).", ""]
    rows = [[r["arch"], r["method"], r["code"], *["—"] * 5, "could not run: " + r["error"]] if "error" in r else
            [r["arch"], r["method"], r["code"], f"{r['loss_a']:.4f}", f"{r['loss_b']:.4f}", f"{r['loss_mid']:.4f}",
             f"{r['gap_mid']:+.4f}", f"{r['metric_mid']:.4f} ({r['metric_name']})", f"{r['seconds']:.1f}"]
            for r in rec["rows"]]
    lines += table(["arch", "method", "code", "L_A", "L_B", "L(mid)", "gap", "metric(mid)", "seconds"], rows,
                   ["l", "l", "l", "r", "r", "r", "r", "r", "r"]) + [""]
    for s in rec["seeds"].values():
        lines += [f"## {s['paper']}", "",
                  f"- code: `{s['repo']}` at `{s['commit']}` (tree `{s['tree']}`, checked before running), "
                  f"driven by `{s['driver']}`; status: **{s['status']}**"
                  + (f" — `{s['error']}`" if s.get("error") else ""),
                  f"- venv: {', '.join(s['requirements'])}; {s['pins']}", f"- run: {s['how']}"]
        if s["status"] == "ran":
            lines += [f"- ran with Python {s['python']}, torch {s['torch']}, transformers {s['transformers']}; "
                      f"parents' max |logit difference| after the exchange: {s['parent_logit_diff']}",
                      f"- run-time shims: {', '.join(s['shims']) or 'none'}"
                      + (f"; untied in their merged model: {', '.join(s['untied'])}" if s.get("untied") else "")]
            lines += [f"- {n}" for n in s.get("notes", [])]
            lines += [f"- variant `{k}`: {v}" for k, v in s.get("variants", {}).items()]
            if s.get("b_transformed_logit_diff"):
                what = s.get("b_check_what", "their transformed B with each untied decoder against B")
                lines.append(f"- {what}, max |logit difference|: "
                             + "; ".join(f"{k}: {v:.3g}" for k, v in s["b_transformed_logit_diff"].items()))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .. import train, zoo
    ap = argparse.ArgumentParser(prog="python -m benchmarks seeds", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(SEEDS), default=list(SEEDS))
    ap.add_argument("--size", choices=zoo.SIZES, default="quick", help="the suite's model size (default quick)")
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 1), help="the pair's training seeds")
    ap.add_argument("--align-batches", type=int, default=8, help="training-split batches given to every method")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds an author's run may take")
    ap.add_argument("--root", default=None, help="where seeds-code/ and seeds-venv-NAME/ are")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--setup", action="store_true", help="make the venvs, then stop")
    a = ap.parse_args(argv)
    root = root_dir(a.root)
    if a.setup:
        return setup(root, a.only)
    torch.set_num_threads(train.num_threads())
    start, ours_state = commit_info(), git_state()  # the run's start names it
    matmul_rates()  # the record's yardstick, measured (once a process) before the runs
    rows, seeds = [], {}
    for name in a.only:
        log(f"{name}: {SEEDS[name].paper} on the suite's {SEEDS[name].arch} pair ...")
        r, seeds[name] = run_seed(SEEDS[name], a, root)
        rows += r
    rec = {"command": command_line(), "commit": start["commit"], "dirty": start["dirty"], "symgraph": ours_state,
           "settings": {"size": a.size, "seeds": list(a.seeds), "align_batches": a.align_batches,
                        "threads": torch.get_num_threads()}, "seeds": seeds, "rows": rows, "not_run": {}}
    write_result(a.out, ".seeds-", rec, markdown, command=rec["command"])  # no entry on a lent device
    log(f"wrote {a.out}/results.json and report.md")
    return 0

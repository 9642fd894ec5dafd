"""Coverage of the vision zoos: every timm family and every torchvision classification family,
its smallest variant built with random weights, traced, analysed, certified and checked for
completeness. A **family** is a module of the zoo (``timm.list_modules()``; the modules of
``torchvision.models`` holding its classification builders). One row per family:

1. **config**: the variant with the fewest parameters (torchvision's ``num_params``, else built on
   the ``meta`` device) among the 8 shortest names with the smallest size word (``atto`` < ... <
   ``small``).
2. **build**: random weights, float32, ``eval()`` (a timm feature extractor given a head); what
   the initialiser leaves constant re-drawn (:func:`redraw`).
3. **run eagerly** on one random image at the first size the forward runs at: 64x64, 96x96, then
   built for that size (``img_size=`` / ``image_size=``), then its config's default; the first
   where a copy in training mode runs too (Inception's training-only head needs its designed
   size). A model no size builds or runs is listed apart with its exception (not counted).
4. **trace + analyse**: ``symgraph.analyze(model, (image,))`` (timed).
5. **certify**: ``report.certify`` in float64, infinite tolerance; sound when ≤ 1e-6.
6. **complete** (:func:`completeness`, from the traced graph): the hidden channels of every
   convolution and linear map, every MLP and every multi-head attention site have their class;
   each missing entry names its module and what blocks it (:mod:`.why`).
7. **ops without a rule**: ``symgraph.cli.coverage.unruled_ops``.

Each family runs in a forked child (:func:`~.family.run_isolated`); ``--budget S``: no family
starts after S seconds, the rest are listed as not run (each zoo's families in a random order of
``--seed``: what ran is a uniform sample). Results: ``coverage_vision.json`` and
``coverage_vision.md`` in ``--out``, and their ``record.json`` entry.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import math
import re
import time
import types
import warnings

from ..harness import script
from ..provenance import REPO_ROOT, command_line, log, table, write_result
from .family import TOL, _first_line, analyse, certify, failed, known, row, run_isolated
from .graph import linear_weight, module_paths, node_shape, pname, slot_source, users_of
from .shrink import redraw_parameters
from .structure import NONLINEAR, PERMLIKE, expectations
from .summary import blocked_by, counts, escape, git_info, head, parser, totals, yes
from .why import fixed_unsaved, frozen_why

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage_vision"
ZOOS = ("timm", "torchvision")
TARGET = 0.90
#: size words of timm's variant names, smallest first
SIZE_WORDS = ("atto", "zepto", "femto", "pico", "nano", "micro", "xxxs", "xxs", "xs", "tiny", "mini",
              "small")
MAX_CANDIDATES = 8
HEAD_CLASSES = 1000  # a head for a variant built without one (timm's ``num_classes=0``)
SIZES = (64, 96)
NORMS = {"batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
         "native_batch_norm", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
         "rms_norm", "_fused_rms_norm", "instance_norm"}
#: ops a channel passes through on its way to a nonlinearity or a norm
THROUGH = {"add", "sub", "mul", "div", "clone", "contiguous", "_to_copy", "alias", "detach", "dropout",
           "transpose", "permute", "view", "reshape", "_unsafe_view", "flatten", "unsqueeze",
           "squeeze", "expand", "to", "type_as", "pad", "constant_pad_nd"}
CONVS = ("convolution", "conv1d", "conv2d", "conv3d")


# --- the families and their smallest variant ------------------------------------------------------


def families(zoos=ZOOS, only=None, seed: int = 0) -> list:
    """``[(family, "", zoo)]``: zoo by zoo, each zoo's families in a random order of ``seed``
    (the variant is chosen in its child)."""
    import random
    out = []
    for zoo in zoos:
        fams = sorted(variants(zoo))
        random.Random(seed).shuffle(fams)
        out += [(fam, "", zoo) for fam in fams if not only or fam in only]
    return out


def variants(zoo: str) -> dict:
    """``{family: [model names]}`` of a zoo."""
    groups = collections.defaultdict(list)
    if zoo == "timm":
        import timm
        groups.update((mod, list(names)) for mod in timm.list_modules() if (names := timm.list_models(module=mod)))
    else:
        import torchvision
        tvm = torchvision.models
        for name in tvm.list_models(module=tvm):
            groups[tvm.get_model_builder(name).__module__.rsplit(".", 1)[-1]].append(name)
    return dict(groups)


def candidates(names) -> list:
    """The names with the smallest size word present (all when none has one), at most
    :data:`MAX_CANDIDATES`, shortest first."""
    def rank(name):
        parts = set(re.split(r"[_\-.]", name.lower()))
        return min((i for i, w in enumerate(SIZE_WORDS) if w in parts), default=len(SIZE_WORDS))
    best = min((rank(n) for n in names), default=0)
    return sorted((n for n in names if rank(n) == best), key=lambda n: (len(n), n))[:MAX_CANDIDATES]


def smallest(names, count) -> tuple:
    """``(name, parameters)`` of the candidate with the fewest parameters (``count(name)``, or an
    exception when it cannot be built); ties: the earlier name."""
    best, n_best, errors = None, math.inf, []
    for name in candidates(names):
        try:
            n = count(name)
        except Exception as e:  # noqa: BLE001 - a variant that cannot be built is not chosen
            errors.append(f"{name}: {type(e).__name__}: {_first_line(e)}")
            continue
        if n < n_best:
            best, n_best = name, n
    if best is None:
        raise RuntimeError("no variant builds: " + "; ".join(errors[:2]))
    return best, n_best


def build(zoo: str, name: str, device=None, size=None, head: bool = True, seed: int = 0):
    """The model (weights from ``seed``, the global generator untouched), eval, for ``size``, with a ``head``."""
    import torch
    with warnings.catch_warnings(), torch.device(device or "cpu"), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        warnings.simplefilter("ignore")
        if zoo == "timm":
            import timm
            kw = {"img_size": size} if size else {}
            model = timm.create_model(name, pretrained=False, **kw)
            if head and getattr(model, "num_classes", None) == 0:  # a feature extractor
                model = timm.create_model(name, pretrained=False, num_classes=HEAD_CLASSES, **kw)
        else:
            import torchvision
            model = torchvision.models.get_model(name, weights=None, **({"image_size": size} if size else {}))
    return redraw(model.eval(), seed)


def redraw(model, seed: int = 0):
    """:func:`~.shrink.redraw_parameters`, then BatchNorm's running statistics (mean in
    [-0.5, 0.5], variance in [0.5, 1.5]): a constant hides a wrong slot. Meta tensors are left alone."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    redraw_parameters(model, gen)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if not b.is_meta and b.is_floating_point() and name.endswith(("running_mean", "running_var")):
                shift = -0.5 if name.endswith("running_mean") else 0.5
                b.copy_(torch.rand(b.shape, generator=gen, dtype=b.dtype) + shift)
    return model


def meta_count(zoo: str):
    """A variant's parameter count: torchvision's own (its weights' ``num_params``), else the
    model built on the ``meta`` device counted."""
    def count(name):
        if zoo == "torchvision":
            import torchvision
            with contextlib.suppress(ValueError, KeyError):
                return min(w.meta["num_params"] for w in torchvision.models.get_model_weights(name))
        return sum(p.numel() for p in build(zoo, name, device="meta", head=False).parameters())
    return count


def default_size(zoo: str, name: str, model) -> tuple:
    """``(channels, height, width)`` of the model's own config."""
    cfg = (getattr(model, "pretrained_cfg", None) or {}) if zoo == "timm" else {}
    if cfg.get("input_size"):
        return tuple(cfg["input_size"])
    return (3, 299, 299) if "inception" in name else (3, 224, 224)


def runnable(zoo: str, name: str):
    """``(model, image, how)``: the first build and image size (the module docstring's stage 3)
    the model's own forward runs at, in training mode too where any size allows."""
    import torch
    model = build(zoo, name)
    chans = default_size(zoo, name, model)[0]
    first = last = None
    for built_for, s in [(None, s) for s in SIZES] + [(s, s) for s in SIZES] + [(None, None)]:
        try:
            m = model if built_for is None else build(zoo, name, size=built_for)
            shape = (chans, s, s) if s else default_size(zoo, name, m)
            x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
            _run(m, x)
        except Exception as e:  # noqa: BLE001 - the next size
            last = e
            continue
        found = m, x, {"input": list(shape), "built_for": built_for}
        first = first or found
        with contextlib.suppress(Exception):  # in training mode too, on two images
            _run(copy.deepcopy(m).train(), torch.randn(2, *shape, generator=torch.Generator().manual_seed(1)))
            return found
    if first is None:
        raise last
    return first


def _run(model, x) -> None:
    """``model``'s own forward on ``x``, without gradients or warnings."""
    import torch
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x)


# --- completeness -----------------------------------------------------------------------------------


def channel_slots(ep) -> list:
    """``[(module, (param, dim))]``: the output-channel slot of each convolution (any groups) or
    linear map whose output reaches a nonlinearity or a norm through :data:`THROUGH` ops and is read
    later by another (a hidden channel, not the model's logits)."""
    users = users_of(ep)
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        slot = _out_slot(ep, n)
        if slot is None or (node_shape(n) or (0, 0))[1:2] == (1,):
            continue
        if _reaches(n, users, lambda u: pname(u) in NONLINEAR or pname(u) in NORMS, lambda u: pname(u) in THROUGH) \
                and _reaches(n, users, lambda u: u.op == "call_function" and _out_slot(ep, u) is not None,
                             lambda u: u.op == "call_function"):
            out.append((next(iter(module_paths(n)), ""), slot))
    return out


def _out_slot(ep, n):
    if pname(n) in CONVS and len(n.args) > 1 and hasattr(n.args[1], "op"):
        if pname(n) == "convolution" and n.args[6]:
            return None  # transposed: its output channels are the weight's dim 1
        return slot_source(ep, n.args[1], 0)
    w = linear_weight(ep, n)
    return None if w is None else w[1]


def _reaches(node, users, hit, through) -> bool:
    """Whether a node ``hit`` accepts follows ``node`` through nodes ``through`` accepts."""
    stack, seen = [node], {node}
    while stack:
        for u in users[stack.pop()]:
            if hit(u):
                return True
            if u not in seen and through(u):
                seen.add(u)
                stack.append(u)
    return False


def completeness(ep, report, tied=()) -> dict:
    """:func:`~.structure.expectations` (no config: no rope) and a ``{"kind": "channels", ...}`` missing
    for each :func:`channel_slots` slot in no permutation-type class, unless a tensor no checkpoint
    stores fixes it (``report.unsaved``: DiT's position table). ``tied``: ``symgraph.tied_parameters``."""
    st = expectations(ep, report, types.SimpleNamespace(), tied)
    alias = {n: g for g in tied for n in g}
    held = {(q, d) for g in report.groups if g.kind in PERMLIKE for p, d in g.params for q in alias.get(p, (p,))}
    slots = channel_slots(ep)
    st["channels"] = len(slots)
    for mod, slot in slots:
        if tuple(slot) not in held and not fixed_unsaved(report, slot):
            st["missing"].append({"kind": "channels", "module": mod, "slots": [list(slot)],
                                  "why": frozen_why(report, slot)})
    return st


# --- one family and the run -----------------------------------------------------------------------


def run_vision(family: str, _unused: str, zoo: str) -> dict:
    """One row: choose, build, run, analyse, certify, check one family; a failure recorded with its stage."""
    import symgraph
    rec = row(family, None, zoo)
    t0 = time.perf_counter()
    try:
        rec["class"], rec["parameters"] = smallest(variants(zoo)[family], meta_count(zoo))
        rec["variants"] = len(variants(zoo)[family])
        rec["stage"] = "build"
        build(zoo, rec["class"])
        rec["stage"] = "eager"
        model, x, how = runnable(zoo, rec["class"])
        rec.update(how, stage="trace")
        tied = symgraph.tied_parameters(model)
        report = analyse(rec, model, (x,), lambda ep, r: completeness(ep, r, tied))
        certify(rec, report, model, (x,), TOL)
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        failed(rec, e)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def summarize(rows) -> dict:
    """Per zoo and overall: :func:`~.summary.counts` (``runs``: what the zoo builds and runs), what
    blocks each missing class, the ops without a rule. Rows never started (``--budget`` spent) count
    only in ``not_run``."""
    not_run = [f"{r['task']}/{r['model_type']}" for r in rows if r["stage"] == "not_run"]
    rows = [r for r in rows if r["stage"] != "not_run"]
    by = {z: counts([r for r in rows if r["task"] == z], TARGET) for z in ZOOS if any(r["task"] == z for r in rows)}
    by["all"] = counts(rows, TARGET)
    blocked, unruled = blocked_by(rows, lambda r: f"{r['task']}/{r['model_type']}")
    return {"by_zoo": by, "target": TARGET, "unsound": sum(r["sound"] is False for r in rows),
            "blocked_by": blocked, "unruled_ops": unruled, "not_run": not_run}


def markdown(res) -> str:
    h, s = res["header"], res["summary"]
    lines = head("Coverage of the vision zoos (timm, torchvision)", h) + [
        f"- {', '.join(f'{k} {v}' for k, v in h['versions'].items())}; {h['jobs']} families at a "
        f"time, timeout {h['timeout_s']:.0f} s, memory limit {h['mem_gb']} GB; wall {h['wall_seconds']:.0f} s",
        "- one row per family (a module of the zoo), its smallest variant by parameter count, random "
        "weights; complete: every channel class, MLP and attention head a vision model must have "
        "(`benchmarks/coverage/vision.py`'s docstring)", "",
        *totals(s["by_zoo"], "zoo", "cannot build", TARGET), "", f"- unsound (certificate > {TOL:g}): {s['unsound']}"]
    if s["not_run"]:
        lines.append(f"- not run ({len(s['not_run'])}: the run's time budget was spent first; families run "
                     f"in a seeded random order within each zoo): {', '.join(s['not_run'])}")
    lines += ["", "## What blocks a class", ""]
    for k, whys in s["blocked_by"].items():
        for why, fams in sorted(whys.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- `{k}` ({len(fams)}): {escape(why)[:300]}: {', '.join(fams)}")
    lines += ["", "## Ops without a rule", ""]
    lines += [f"- `{op}` ({len(f)}): {', '.join(f)}" for op, f in s["unruled_ops"].items()] or ["- none"]
    lines += ["", "## Every family", ""]
    lines += table(["zoo", "family", "model", "params", "input", "stage", "certificate", "sound", "complete",
                    "missing", "unruled ops", "analyse s", "error"], [_row(r) for r in res["rows"]])
    return "\n".join(lines) + "\n"


def _row(r) -> list:
    miss = collections.Counter(m["kind"] for m in (r.get("structure") or {}).get("missing", []))
    err = r.get("error") or {}
    return [r["task"], r["model_type"], r.get("class") or "-", r.get("parameters", "-"),
            "x".join(map(str, r.get("input") or [])) or "-", r["stage"],
            "-" if r["certificate"] is None else f"{r['certificate']:.1e}", yes(r["sound"]), yes(r["complete"]),
            ", ".join(f"{k} {v}" for k, v in sorted(miss.items())) or "-",
            len(r.get("unruled_ops") or {}) if r["traced"] else "-",
            "-" if r.get("analyze_seconds") is None else f"{r['analyze_seconds']:.1f}",
            escape(f"{err.get('type')}: {err.get('message', '')}")[:160] if err else ""]


def run(out=None, zoos=ZOOS, only=None, jobs=2, timeout=120.0, mem_gb=6.0, command=None, log=None,
        budget=None, seed=0) -> dict:
    """The rows (those not started by ``budget`` seconds: stage ``not_run``); the table into ``out``."""
    import timm
    import torch
    import torchvision
    t0, git = time.perf_counter(), git_info()
    fams = known(families(zoos, only, seed), only)
    stop = None if budget is None else (lambda: time.perf_counter() - t0 > budget)
    rows = run_isolated(fams, jobs, timeout, mem_gb, log, run=run_vision, warm=("resnet", "", "torchvision"), stop=stop)
    rows = [r or row(f[0], None, f[2], "not_run") for r, f in zip(rows, fams)]
    res = {"header": {"command": command or "python -m benchmarks.coverage.vision", "git": git,
                      "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                                   "timm": timm.__version__},
                      "jobs": jobs, "timeout_s": timeout, "mem_gb": mem_gb, "tolerance": TOL, "zoos": list(zoos),
                      "only": only, "budget_s": budget, "seed": seed, "wall_seconds": time.perf_counter() - t0},
           "summary": summarize(rows), "rows": rows}
    if out:
        write_result(out, ".coverage-vision-", res, markdown, json_name="coverage_vision.json",
                     md_name="coverage_vision.md", command=res["header"]["command"])
    return res


def main(argv=None) -> int:
    ap = parser("python -m benchmarks.coverage.vision", __doc__.splitlines()[0], DEFAULT_OUT, 1, 300.0, 18.0,
                tasks=False)
    ap.add_argument("--zoo", nargs="+", choices=ZOOS, default=list(ZOOS))
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no family starts")
    ap.add_argument("--seed", type=int, default=0, help="the order of each zoo's families (default 0)")
    a = ap.parse_args(argv)
    res = run(a.out, tuple(a.zoo), a.only, a.jobs, a.timeout, a.mem_gb or None,
              command_line(argv, "benchmarks.coverage.vision"), log, a.budget, a.seed)
    for z, b in res["summary"]["by_zoo"].items():
        print(f"{z}: tried {b['tried']} runs {b['runs']} traced {b['traced']} sound {b['sound']} "
              f"complete {b['complete']} sound+complete {b['sound_and_complete']}")
    return 0


if __name__ == "__main__":
    script(main)

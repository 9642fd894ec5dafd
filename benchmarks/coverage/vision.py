"""Coverage of the vision zoos: every timm family and every torchvision classification family,
its smallest variant built with random weights, traced, analysed, certified and checked for
completeness (issue 65, item 4).

A **family** is a module of the zoo: ``timm.list_modules()`` (``resnet``, ``vision_transformer``,
...) and the modules of ``torchvision.models`` that hold its classification models
(``torchvision.models.list_models(module=torchvision.models)`` grouped by the module of each
builder). One row per family:

1. **config** (choose the variant): the smallest variant by parameter count (torchvision's
   own ``num_params`` of its weights; else each candidate built on the ``meta`` device). timm families with many variants are first narrowed by
   the size words of their names (``atto`` < ``femto`` < ... < ``tiny`` < ``small``: the smallest
   word present), then the 8 shortest names are counted.
2. **build**: random weights (``pretrained=False`` / ``weights=None``; a timm feature extractor,
   ``num_classes=0``, whose stream is its output, given a head), float32, ``eval()``; what
   the initialiser leaves constant re-drawn (:func:`redraw`: norms, biases, layer scales, zero
   heads, BatchNorm's running statistics).
3. **run eagerly**: the model's own forward on one random image, at the first size it runs at:
   64x64, 96x96 (the default build), then built for that size (``img_size=`` in timm,
   ``image_size=`` in torchvision), then its config's default; the first where a copy in
   training mode runs too, on two images (Inception's training-only head needs its designed
   size). A model no size builds or runs is listed apart with its exception (not counted).
4. **trace + analyse**: ``symgraph.analyze(model, (image,))`` (timed).
5. **certify**: ``report.certify`` in float64 (the model cast), infinite tolerance so the value is
   recorded; sound when ≤ 1e-6.
6. **complete**, from the traced graph (never from module names):

   - *channels*: the output channels of every convolution (grouped and depthwise included) and
     every linear map whose output reaches a nonlinearity or a norm (batch, layer, group or RMS
     norm) through elementwise and layout ops, and is read later by another convolution or
     linear map (hidden channels, not logits), belong to a permutation-type class of the report
     (``report.groups`` of a kind from ``perm`` up; a channel axis in ``report.frozen`` fails);
   - *MLPs*: every up projection - nonlinearity - down projection pair shares such a class
     (:func:`~.structure.mlp_units`: conv-BN-ReLU-conv included);
   - *attention heads*: every attention site with more than one head has a class with head
     blocks (:func:`~.attention.attention_units`).

   A model whose analysis misses any of them is incomplete; each missing entry names its module
   and what blocks it (:mod:`.why`).
7. **ops without a rule**: ``symgraph.cli.coverage.unruled_ops``.

Each family runs in a forked child (:func:`~.family.run_isolated`: memory limit, timeout);
``--budget S``: no family starts after S seconds, the rest are listed as not run (each zoo's
families go in a random order of ``--seed``, so what ran is a uniform sample).
Results: ``coverage_vision.json`` and ``coverage_vision.md`` in ``--out``, headed by the command
and the commit, and their entry in the directory's ``record.json``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import math
import re
import time
import types
import warnings

from ..harness import script
from ..provenance import REPO_ROOT, command_line, log, write_result
from .constants import TOL
from .family import _first_line, _one_trace, blockers, run_isolated, where
from .graph import pname, node_shape, slot_source, linear_weight
from .structure import NONLINEAR, PERMLIKE, expectations
from .summary import git_info
from .vision_table import TARGET, ZOOS, markdown, summarize  # noqa: F401 - re-exported
from .why import fixed_unsaved, frozen_why

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage_vision"
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
    """``[(family, "", zoo)]``: every family of each zoo (the variant is chosen in its child),
    zoo by zoo, each zoo's in a random order drawn from ``seed`` (a run whose ``--budget`` ends
    before the last family has run a uniform sample of the zoo)."""
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
    """The names worth counting: those with the smallest size word present (all when none has
    one), at most :data:`MAX_CANDIDATES`, shortest first."""
    def rank(name):
        parts = set(re.split(r"[_\-.]", name.lower()))
        return min((i for i, w in enumerate(SIZE_WORDS) if w in parts), default=len(SIZE_WORDS))
    best = min((rank(n) for n in names), default=0)
    keep = [n for n in names if rank(n) == best]
    return sorted(keep, key=lambda n: (len(n), n))[:MAX_CANDIDATES]


def smallest(names, count) -> tuple:
    """``(name, parameters)`` of the candidate with the fewest parameters (``count(name)``:
    its count, or an exception when it cannot be built); ties: the earlier name."""
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
    """The model (weights from ``seed``, global generator untouched; issue 69), eval, for ``size``, with a ``head``."""
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
    """Re-draw what an initialiser leaves constant, as :func:`~.shrink.build` does: every 1-d
    parameter (``*weight`` 1 + 0.5·N, else 0.5·N), every constant matrix (a zero head: 0.02·N)
    and BatchNorm's running statistics (mean in [-0.5, 0.5], variance in [0.5, 1.5]); a constant hides a
    wrong slot from the certificate. Meta models are left alone."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    rand = lambda t, f: t.copy_(f(torch.rand(t.shape, generator=gen, dtype=t.dtype)))  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta or not p.is_floating_point():
                continue
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0)
                        + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif p.numel() > 1 and float(p.std()) == 0.0:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in model.named_buffers():
            if not b.is_meta and b.is_floating_point() and name.endswith("running_mean"):
                rand(b, lambda u: u - 0.5)
            elif not b.is_meta and b.is_floating_point() and name.endswith("running_var"):
                rand(b, lambda u: u + 0.5)
    return model


def meta_count(zoo: str):
    """A variant's parameter count: torchvision's own (its weights' ``num_params``), else the
    model built on the ``meta`` device counted."""
    def count(name):
        if zoo == "torchvision":
            import torchvision
            try:
                return min(w.meta["num_params"] for w in torchvision.models.get_model_weights(name))
            except (ValueError, KeyError):
                pass
        return sum(p.numel() for p in build(zoo, name, device="meta", head=False).parameters())
    return count


def default_size(zoo: str, name: str, model) -> tuple:
    """``(channels, height, width)`` of the model's own config."""
    if zoo == "timm":
        cfg = getattr(model, "pretrained_cfg", None) or {}
        if cfg.get("input_size"):
            return tuple(cfg["input_size"])
    return (3, 299, 299) if "inception" in name else (3, 224, 224)


def runnable(zoo: str, name: str):
    """``(model, image, how)``: the first build and image size (see the module's docstring,
    stage 3) the model's own forward runs at, in training mode too where any size allows."""
    import torch
    model = build(zoo, name)
    chans = default_size(zoo, name, model)[0]
    tries = [(None, s) for s in SIZES] + [(s, s) for s in SIZES] + [(None, None)]
    first = last = None
    for built_for, s in tries:
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
    """``[(module, (param, dim))]``: the output-channel slot of each convolution (any groups)
    or linear map whose output reaches a nonlinearity or a norm through :data:`THROUGH` ops,
    and then another convolution or linear map (a hidden channel: a classifier's logits are
    the model's output, whatever follows them)."""
    users = collections.defaultdict(list)
    for n in ep.graph.nodes:
        for a in n.all_input_nodes:
            users[a].append(n)
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        slot = _out_slot(ep, n)
        if slot is None or (node_shape(n) or (0, 0))[1:2] == (1,) or not _feeds(n, users) \
                or not _read_later(ep, n, users):
            continue
        mods = [p for p, _ in reversed(list((n.meta.get("nn_module_stack") or {}).values()))]
        out.append((_clean(mods[0]) if mods else "", slot))
    return out


def _out_slot(ep, n):
    if pname(n) in CONVS and len(n.args) > 1 and hasattr(n.args[1], "op"):
        if pname(n) == "convolution" and n.args[6]:
            return None  # transposed: its output channels are the weight's dim 1
        return slot_source(ep, n.args[1], 0)
    w = linear_weight(ep, n)
    return None if w is None else w[1]


def _feeds(node, users) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in users[n]:
            name = pname(u)
            if name in NONLINEAR or name in NORMS:
                return True
            if name in THROUGH and u not in seen:
                seen.add(u)
                stack.append(u)
    return False


def _read_later(ep, node, users) -> bool:
    """Whether any op downstream of ``node`` is a convolution or linear map of a parameter."""
    stack, seen = [node], {node}
    while stack:
        for u in users[stack.pop()]:
            if u not in seen and u.op == "call_function":
                if _out_slot(ep, u) is not None:
                    return True
                seen.add(u)
                stack.append(u)
    return False


def _clean(path: str) -> str:
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


def completeness(ep, report, tied=()) -> dict:
    """:func:`~.structure.expectations` (MLPs, attention heads; no config: no rope) and the
    channel classes (:func:`channel_slots`): ``missing`` holds ``{"kind": "channels", ...}``
    for each channel slot in no permutation-type class, unless a tensor no checkpoint stores
    fixes it (``report.unsaved``: DiT's stream, to which its recomputed position table is added,
    cannot move in a checkpoint). ``tied``: ``symgraph.tied_parameters`` (CoaT runs one MLP
    on three scales: the graph reads it under any name, the report names it once)."""
    st = expectations(ep, report, types.SimpleNamespace(), tied)
    alias = {n: g for g in tied for n in g}
    held = {(q, d) for g in report.groups if g.kind in PERMLIKE for p, d in g.params
            for q in alias.get(p, (p,))}
    slots = channel_slots(ep)
    st["channels"] = len(slots)
    for mod, slot in slots:
        if tuple(slot) not in held and not fixed_unsaved(report, slot):
            st["missing"].append({"kind": "channels", "module": mod, "slots": [list(slot)],
                                  "why": frozen_why(report, slot)})
    return st


# --- one family ---------------------------------------------------------------------------------


def run_vision(family: str, _unused: str, zoo: str) -> dict:
    """One row: choose, build, run, analyse, certify, check one family (each stage's failure
    recorded, as :func:`~.family.run_family` does)."""
    rec = {"model_type": family, "class": None, "task": zoo, "stage": "config", "traced": False,
           "sound": None, "complete": None, "certificate": None, "error": None}
    t0 = time.perf_counter()
    stage = "config"
    try:
        rec["class"], rec["parameters"] = smallest(variants(zoo)[family], meta_count(zoo))
        rec["variants"] = len(variants(zoo)[family])
        stage = "build"
        build(zoo, rec["class"])
        stage = "eager"
        model, x, how = runnable(zoo, rec["class"])
        rec.update(how)
        stage = "trace"
        report = _analyse(rec, model, x)
        stage = "certify"
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            worst = report.certify(model, (x,), tol=math.inf)
        f32 = any("float32" in str(w.message) for w in caught)
        rec["certify_seconds"] = time.perf_counter() - t
        rec["certificate"], rec["certificate_dtype"] = worst, "float32" if f32 else "float64"
        rec["sound"] = bool(worst <= TOL)
        stage = "done"
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        if isinstance(e, KeyboardInterrupt):
            raise
        rec["error"] = {"stage": stage, "type": type(e).__name__, "message": _first_line(e),
                        "where": where(e)}
    rec["stage"] = stage
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _analyse(rec, model, x):
    import symgraph
    import symgraph.passes.trace as tr
    from symgraph.cli.coverage import unruled_ops
    inputs = (x,)
    with _one_trace():
        t = time.perf_counter()
        report = symgraph.analyze(model, inputs)
        rec["analyze_seconds"] = time.perf_counter() - t
        rec["traced"] = True
        rec["groups"] = len(report.groups)
        rec["group_kinds"] = dict(sorted(collections.Counter(g.kind for g in report.groups).items()))
        rec["frozen"] = sorted({(str(f.op), f.module) for f in report.frozen})
        rec["unruled_ops"] = dict(sorted(unruled_ops(model, inputs).items()))
        rec["structure"] = completeness(tr.trace(model, inputs)[0], report,
                                          symgraph.tied_parameters(model))
        rec["complete"] = not rec["structure"]["missing"]
        rec["blockers"] = blockers(rec)
    return report


def versions() -> dict:
    import timm
    import torch
    import torchvision
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "timm": timm.__version__}


def run(out=None, zoos=ZOOS, only=None, jobs=2, timeout=120.0, mem_gb=6.0, command=None, log=None,
        budget=None, seed=0) -> dict:
    """Run the families (``budget``: seconds after which no family starts; those not started
    are rows of stage ``not_run``) and write the table into ``out``."""
    t0 = time.perf_counter()
    git = git_info()
    fams = families(zoos, only, seed)
    if only and len({f[0] for f in fams}) < len(set(only)):
        raise SystemExit(f"unknown families: {', '.join(sorted(set(only) - {f[0] for f in fams}))}")
    stop = None if budget is None else (lambda: time.perf_counter() - t0 > budget)
    rows = run_isolated(fams, jobs, timeout, mem_gb, log, run=run_vision, warm=("resnet", "", "torchvision"), stop=stop)
    rows = [r or {"model_type": f[0], "class": None, "task": f[2], "stage": "not_run", "traced": False,
                  "sound": None, "complete": None, "certificate": None, "error": None} for r, f in zip(rows, fams)]
    res = {"header": {"command": command or "python -m benchmarks.coverage.vision", "git": git,
                      "versions": versions(), "jobs": jobs, "timeout_s": timeout, "mem_gb": mem_gb,
                      "tolerance": TOL, "zoos": list(zoos), "only": only, "budget_s": budget, "seed": seed,
                      "wall_seconds": time.perf_counter() - t0},
           "summary": summarize(rows), "rows": rows}
    if out:
        write_result(out, ".coverage-vision-", res, markdown, json_name="coverage_vision.json",
                     md_name="coverage_vision.md", command=res["header"]["command"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.coverage.vision", description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", nargs="+", choices=ZOOS, default=list(ZOOS))
    ap.add_argument("--only", nargs="+", default=None, metavar="FAMILY", help="families to run (default: all)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=1, help="families at a time (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per family (default 300)")
    ap.add_argument("--mem-gb", type=float, default=18.0, help="address-space limit per family in GB "
                    "(0: none; default 18, for a 412M ViT's float64 certificate)")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no family starts")
    ap.add_argument("--seed", type=int, default=0, help="the order of each zoo's families (default 0)")
    a = ap.parse_args(argv)
    command = command_line(argv, "benchmarks.coverage.vision")
    res = run(a.out, tuple(a.zoo), a.only, a.jobs, a.timeout, a.mem_gb or None, command, log, a.budget, a.seed)
    for z, b in res["summary"]["by_zoo"].items():
        print(f"{z}: tried {b['tried']} runs {b['runs']} traced {b['traced']} sound {b['sound']} "
              f"complete {b['complete']} sound+complete {b['sound_and_complete']}")
    return 0


if __name__ == "__main__":
    script(main)

"""What a merge records beside the merged model: ``symgraph_merge.json`` (:func:`record`: the
inputs, every option with the method's parameters, the dtypes, the path taken, the solvers'
results, REPAIR's, the architecture and width changes) and the model card (:func:`card`: the
config that reproduces the merge and a summary), the same on both paths."""
from __future__ import annotations

import os

from .._version import __version__
from ..checkpoints.outdir import model_card
from ..merging.methods.registry import get as get_method
from ..checkpoints.specs import width_change
from .config import to_yaml

__all__ = ["record", "architecture_change", "card"]


def record(cfg, data, names, *, mode, seconds, alignments, dtype, input_dtypes, configs, parent, merged, anchor=0,
           repair=None, universe=None) -> dict:
    """The record ``symgraph_merge.json`` holds, the same keys on both paths (``mode``):
    ``data``, the batches the merge read (None: none); ``names``, the inputs as recorded
    (:attr:`~symgraph.checkpoints.inputs.Inputs.names`); ``dtype`` the merged model's and
    ``input_dtypes`` the inputs'; ``configs``, the inputs' configs, whose widths are compared
    with the ``anchor``'s; ``parent`` (the anchor's model) and ``merged`` (on ``meta`` out of
    core), whose architectures are compared; REPAIR's report (``repair``, a
    :class:`~symgraph.merging.repair.RepairReport`) and the shared ``universe``'s rounds (None: an anchor)."""
    changes, widths = architecture_change(parent, merged), width_change(configs, cfg.models, anchor)
    options = cfg.model_dump(exclude={"models", "out", "force"})
    options["parameters"] = get_method(cfg.method, **cfg.parameters).params.model_dump()  # defaults too
    options["data"] = os.path.abspath(cfg.data) if cfg.data and data else None
    options["data_batches"] = len(data) if data else 0
    return {"symgraph_version": __version__, "inputs": list(names), "options": options,
            "dtype": str(dtype).removeprefix("torch."), "mode": mode, "seconds": seconds,
            "alignments": _solver_summary(alignments), "repair": repair.to_dict() if repair is not None else None,
            "input_dtypes": [str(d).removeprefix("torch.") for d in input_dtypes],
            "architecture": changes, "width_change": widths, "universe": universe}


def architecture_change(parent, merged) -> list:
    """What the merged model changes of the parents' architecture (circuit-space heads, an
    untied head), each as one sentence; empty when it has the parents' architecture."""
    changes = []
    pc, mc = getattr(parent, "config", None), getattr(merged, "config", None)
    if pc is not None and mc is not None:
        if getattr(pc, "head_dim", None) != getattr(mc, "head_dim", None):
            changes.append(f"attention heads are {mc.head_dim} wide instead of {pc.head_dim} (circuit space: each "
                           "head interpolates the parents' QK and OV forms; 2x the attention parameters per "
                           "model merged)")
        if getattr(pc, "tie_word_embeddings", False) and not getattr(mc, "tie_word_embeddings", False):
            extra = sum(p.numel() for p in merged.parameters()) - sum(p.numel() for p in parent.parameters())
            changes.append(f"the head is untied from the embedding: {extra} more parameters (one vocabulary x "
                           "width matrix)")
    return changes


def card(cfg, out: str, meta: dict) -> str:
    """The model card: the config that reproduces the merge wherever it is run (the inputs and
    ``out`` as absolute paths, the inputs as the record ``meta`` names them: a config's relative
    paths are relative to the config file) and a summary of the record."""
    summary, data = _card_summary(meta), os.path.abspath(cfg.data) if cfg.data else None
    return model_card(to_yaml(cfg.model_copy(update={"models": meta["inputs"], "data": data}), out), summary)


def _solver_summary(alignments):
    out = []
    for i, al in enumerate(alignments):
        if al is None:
            continue
        groups = [{"group": gid, "objective": getattr(res, "objective", None),
                   "status": getattr(res, "status", None), "seconds": getattr(res, "seconds", None)}
                  for gid, res in sorted(getattr(al, "results", {}).items(), key=lambda kv: str(kv[0]))]
        out.append({"model": i, "similarity": getattr(al, "similarity", None), "groups": groups,
                    "seconds": dict(getattr(al, "seconds", {}) or {}),  # solver time, sweeps run
                    "refined": dict(getattr(al, "refined", {}) or {})})
    return out


def _card_summary(meta) -> str:
    lines = [f"symgraph {meta['symgraph_version']}, weights in {meta['dtype']}, {meta['seconds']:.1f} s."]
    for al in meta["alignments"]:
        by: dict[str, int] = {}
        for g in al["groups"]:
            by[g["status"]] = by.get(g["status"], 0) + 1
        stats = ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
        lines.append(f"- model {al['model']} aligned to model 0 from {al['similarity']}: "
                     f"{len(al['groups'])} symmetry groups solved ({stats}).")
    if not meta["alignments"]:
        lines.append("- no alignment (plain combination in each model's own basis).")
    lines += [f"- architecture change: {c}." for c in meta.get("architecture", [])]
    lines += [f"- width change: {c} (transported into the anchor's widths by the alignment)."
              for c in meta.get("width_change") or []]
    kinds = list(dict.fromkeys(meta.get("input_dtypes") or []))
    if len(kinds) > 1:
        lines.append(f"- the inputs are stored in {' and '.join(kinds)}: merged in float32 (or wider) and "
                     f"written in the anchor's {meta['dtype']}.")
    rep = meta.get("repair")
    if rep and rep["layers"]:
        n = len(rep["layers"])
        before = sum(x["before"] for x in rep["layers"]) / n
        after = sum(x["after"] for x in rep["layers"]) / n
        lines.append(f"- REPAIR: {n} layers renormalised to the inputs' interpolated activation "
                     f"statistics (mean |std/target - 1| {before:.3g} -> {after:.3g}).")
    if rep and rep.get("batchnorm"):
        lines.append(f"- REPAIR: BatchNorm running statistics of {len(rep['batchnorm'])} layers "
                     "recomputed on the data for the merged model.")
    return "\n".join(lines)

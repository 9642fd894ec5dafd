"""An alignment as a file: :func:`save_alignment` writes the group elements and transport maps
of an :class:`~symgraph.alignment.result.Alignment` (index vectors, per-head maps, residual
maps, keyed by the report's group ids) and A's norm gauge into one small safetensors file,
with the analysis options and a fingerprint of each model's symmetry structure in its
metadata; :func:`load_alignment` reads it back as an :class:`Alignment` that carries any model
of B's architecture (B itself, or a fine-tune of B, which shares B's basis) into A's basis.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from ..core.elements import Map, Perm
from ..errors import InputError
from .result import Alignment

__all__ = ["save_alignment", "load_alignment", "fingerprint", "FORMAT"]

FORMAT = "symgraph-alignment/1"


def fingerprint(report) -> str:
    """A digest of what an alignment depends on in a model: every group (id, kind, sizes, the
    slots it acts on and how) and every parameter's shape. Two models of one architecture and
    width share it; the weights' values do not enter."""
    groups = [[g.id, g.kind, g.size, g.dim, g.blocks, [list(map(str, p)) for p in g.params], list(g.variance),
               list(g.outer)] for g in report.groups]
    shapes = [[n, list(report.param_shape(n))] for n in report.parameters]
    text = json.dumps([groups, shapes, [[f.gain, f.shift] for f in report.folds]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save_alignment(al: Alignment, path: str, *, options: dict | None = None) -> str:
    """Write ``al`` into ``path`` (a ``.safetensors`` file); ``options``: the analysis options
    (``fold_norms``, ``outputs``) a loader must analyse the model it carries with. Returns the
    path. Elements are stored in their own dtype (permutations as int64 indices)."""
    from safetensors.torch import save_file
    tensors, kinds = {}, {}
    for gid, el in al.elements.items():
        key = f"element.{gid}"
        if isinstance(el, Perm):
            tensors[key + ".index"], kinds[str(gid)] = el.index.detach().cpu().contiguous(), "perm"
        elif isinstance(el, Map):
            tensors[key + ".co"] = el.co.detach().cpu().contiguous()
            tensors[key + ".contra"] = el.contra.detach().cpu().contiguous()
            kinds[str(gid)] = "map"
        elif torch.is_tensor(el):
            tensors[key] = el.detach().cpu().contiguous()
            kinds[str(gid)] = "perm-matrix" if getattr(el, "_symgraph_perm", False) else (
                "orthogonal" if getattr(el, "_symgraph_orth", False) else "matrix")
        else:  # pragma: no cover - the driver makes only these
            raise InputError(f"cannot save the element of group {gid}: {type(el).__name__}")
    for name, t in (al.gauge or {}).items():
        tensors[f"gauge.{name}"] = t.detach().cpu().contiguous()
    if al.report_a is not None:
        prints = {"a": fingerprint(al.report_a), "b": fingerprint(al.report_b)}
    else:  # a loaded alignment saved again
        prints = dict(al.fingerprints)
    meta = {"format": FORMAT, "kinds": kinds, "similarity": al.similarity,
            "options": dict(options if options is not None else al.options),
            "fingerprint_a": prints.get("a"), "fingerprint_b": prints.get("b")}
    save_file(tensors, path, metadata={"symgraph": json.dumps(meta)})
    return path


def load_alignment(path: str) -> Alignment:
    """The alignment saved in ``path`` (a file from :func:`save_alignment`, or a directory
    ``symgraph align`` wrote, holding ``symgraph_alignment.safetensors``). Its reports are
    None: :meth:`Alignment.apply` analyses the model it is given and refuses one whose
    symmetry structure differs from B's (another architecture or width)."""
    from safetensors import safe_open
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        p = os.path.join(p, ALIGNMENT_FILE)
    from ..core.files import check_input_file
    check_input_file(p, "alignment", f"a {ALIGNMENT_FILE} file written by symgraph align (or the directory "
                     "holding it)")
    try:
        with safe_open(p, framework="pt") as f:
            raw = (f.metadata() or {}).get("symgraph")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # not a safetensors file at all
        raise InputError(f"{path!r} is not a safetensors file ({str(e)[:80]}); expected a {ALIGNMENT_FILE} "
                         "written by symgraph align") from None
    try:
        meta = json.loads(raw or "")
        ok = meta.get("format") == FORMAT
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise InputError(f"{path!r} holds no symgraph alignment (its metadata has no {FORMAT!r} record); "
                         "expected a file written by symgraph align")
    elements = {}
    for gid, kind in meta["kinds"].items():
        key, g = f"element.{gid}", int(gid)
        if kind == "perm":
            elements[g] = Perm(tensors[key + ".index"])
        elif kind == "map":
            elements[g] = Map(tensors[key + ".co"], tensors[key + ".contra"])
        else:
            el = tensors[key]
            if kind == "perm-matrix":
                el._symgraph_perm = True
            elif kind == "orthogonal":
                el._symgraph_orth = True
            elements[g] = el
    gauge = {k.removeprefix("gauge."): v for k, v in tensors.items() if k.startswith("gauge.")}
    al = Alignment(report_a=None, report_b=None, elements=elements, similarity=meta.get("similarity"),
                   gauge=gauge)
    al.fingerprints = {"a": meta.get("fingerprint_a"), "b": meta.get("fingerprint_b")}
    al.options = meta.get("options") or {}
    return al


ALIGNMENT_FILE = "symgraph_alignment.safetensors"

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
import math
import os

import torch

from ..core.dtypes import SAFETENSORS_DTYPES
from ..core.elements import Map, Perm, mark_orth, mark_perm
from ..errors import InputError
from .checks import ElementGroup, check_element, check_element_shape

__all__ = ["save_alignment", "read_alignment", "fingerprint", "structure", "FORMAT", "ALIGNMENT_FILE"]

FORMAT = "symgraph-alignment/1"


def structure(report) -> str:
    """What :func:`fingerprint` digests, as JSON text: every group (id, kind, sizes, the slots it
    acts on and how), every parameter's shape and the folds. Saved with an alignment, so that
    its elements can be checked against their groups when it is read (the text's digest is
    the fingerprint a model to carry must match)."""
    groups = [[g.id, g.kind, g.size, g.dim, g.blocks, [list(map(str, p)) for p in g.params], list(g.variance),
               list(g.outer)] for g in report.groups]
    shapes = [[n, list(report.param_shape(n))] for n in report.parameters]
    return json.dumps([groups, shapes, [[f.gain, f.shift] for f in report.folds]], sort_keys=True, default=str)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fingerprint(report) -> str:
    """A digest of what an alignment depends on in a model: every group (id, kind, sizes, the
    slots it acts on and how) and every parameter's shape. Two models of one architecture and
    width share it; the weights' values do not enter."""
    return _digest(structure(report))


def save_alignment(al, path: str, *, options: dict | None = None) -> str:
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
        texts = {"a": structure(al.report_a), "b": structure(al.report_b)}
    else:  # a loaded alignment saved again
        texts = dict(getattr(al, "structures", None) or {})
        if set(texts) != {"a", "b"}:
            raise InputError("cannot save an alignment without its models' reports (or the structure a loaded "
                             "alignment carries); expected the result of symgraph.align or load_alignment")
    meta = {"format": FORMAT, "kinds": kinds, "similarity": al.similarity,
            "options": dict(options if options is not None else al.options),
            "fingerprint_a": _digest(texts["a"]), "fingerprint_b": _digest(texts["b"]),
            "structure_a": texts["a"], "structure_b": texts["b"]}
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(str(path))))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the directory of the alignment file {str(path)!r} does not exist; expected an "
                                "existing directory")
    save_file(tensors, path, metadata={"symgraph": json.dumps(meta)})
    return path


def read_alignment(path: str) -> dict:
    """The fields of the :class:`~symgraph.alignment.result.Alignment` saved in ``path``
    (:func:`~symgraph.alignment.result.load_alignment` builds it): the alignment in ``path`` (a file from :func:`save_alignment`, or a directory
    ``symgraph align`` wrote, holding ``symgraph_alignment.safetensors``). Its reports are
    None: :meth:`Alignment.apply` analyses the model it is given and refuses one whose
    symmetry structure differs from B's (another architecture or width).

    Parsing is bounded: the metadata must be this format's record with every key; the saved
    structure of A and B (whose digests are the fingerprints a model to carry must match) names
    the groups; the file's tensors must be exactly the listed elements (of B's groups) and A's
    folded gains, of the shapes those groups give (checked from the header, before any tensor
    is read); and each element must be in its group (:func:`~.checks.check_element`). Anything
    else is an :class:`InputError` naming the file, the group and what was expected."""
    from safetensors import safe_open
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        p = os.path.join(p, ALIGNMENT_FILE)
    from ..core.files import check_input_file
    check_input_file(p, "alignment", f"a {ALIGNMENT_FILE} file written by symgraph align (or the directory "
                     "holding it)")
    where = f"alignment file {p!r}"

    def bad_file(e):
        return InputError(f"{path!r} is not a safetensors file ({str(e)[:80]}); expected a {ALIGNMENT_FILE} "
                          "written by symgraph align")
    try:
        with safe_open(p, framework="pt") as f:
            raw = (f.metadata() or {}).get("symgraph")
            header = {k: (_dtype_name(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as e:  # not a safetensors file at all
        raise bad_file(e) from None
    meta, groups, shapes, folds = _parse_meta(raw, where)
    plan = _plan(header, meta["kinds"], groups, shapes, folds, where)  # names, dtypes, shapes: before reading
    try:
        with safe_open(p, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in header}
    except Exception as e:  # a truncated or corrupted data section
        raise bad_file(e) from None
    elements = {gid: _element(tensors, f"element.{gid}", kind, groups[gid], where) for gid, kind in plan}
    gauge = _gauge(tensors, where)
    return dict(report_a=None, report_b=None, elements=elements, similarity=meta.get("similarity"), gauge=gauge,
                fingerprints={"a": meta["fingerprint_a"], "b": meta["fingerprint_b"]},
                structures={"a": meta["structure_a"], "b": meta["structure_b"]}, options=meta.get("options") or {})


def _element(tensors, key, kind, g, where):
    """The saved element at ``key`` of ``kind``, checked to be in group ``g``."""
    el: Perm | Map | torch.Tensor
    if kind == "perm":
        el = Perm.__new__(Perm)
        el.index = tensors[key + ".index"]  # checked (integer, in range, each once) before any cast
        check_element(el, g, stored=kind, where=where)
        el.index = el.index.long()
        return el
    if kind == "map":
        el = Map(tensors[key + ".co"], tensors[key + ".contra"])
        check_element(el, g, stored=kind, where=where)
        return el
    mat = tensors[key]
    check_element(mat, g, stored=kind, where=where)
    if kind == "perm-matrix":
        return mark_perm(mat)
    return mark_orth(mat) if kind == "orthogonal" else mat


def _gauge(tensors, where) -> dict:
    """A's folded norm gains saved beside the elements, each finite floating point."""
    gauge = {k.removeprefix("gauge."): v for k, v in tensors.items() if k.startswith("gauge.")}
    for name, t in gauge.items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise InputError(f"{where}: gauge tensor {name!r} (model A's folded norm gain) is not finite floating "
                             "point; expected A's finite gain")
    return gauge


_SAVED_KINDS = ("perm", "map", "perm-matrix", "orthogonal", "matrix")


def _dtype_name(d) -> str:
    return str(d).upper()


def _parse_meta(raw, where):
    """The metadata record, refused unless it is this format's, with every key present and of
    its type; with B's (and A's) groups (``{id: ElementGroup}``) read from the saved structure
    after checking it against its fingerprint."""
    meta = _record(raw, where)
    parsed = {side: _structure(meta, side, where) for side in ("a", "b")}
    (tb, _, folds), (ta, shapes, _) = parsed["b"], parsed["a"]  # the gauge holds A's gains: A's shapes
    groups = {}
    for gid, (kind, size, dim, blocks, outer) in tb.items():
        a = ta.get(gid)
        groups[gid] = ElementGroup(gid, kind, dim, blocks, _fibre(tb, gid), a[2] if a else None,
                                   _fibre(ta, gid) if a else None)
    return meta, groups, shapes, folds


def _record(raw, where):
    """The metadata record as JSON, refused unless it is this format's with every key present
    and of its type."""
    try:
        meta = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{where}: its 'symgraph' metadata is not JSON ({str(e)[:60]}); expected the "
                         f"{FORMAT!r} record symgraph align writes") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = ("no 'symgraph' metadata" if raw is None else "metadata that is not a JSON object"
                 if not isinstance(meta, dict) else f"format {meta.get('format')!r}")
        raise InputError(f"{where} holds no symgraph alignment ({found}); expected a file written by symgraph "
                         f"align (format {FORMAT!r})")
    types = {"kinds": dict, "options": dict, "fingerprint_a": str, "fingerprint_b": str, "structure_a": str,
             "structure_b": str}
    for k, t in types.items():
        if not isinstance(meta.get(k), t):
            found = "missing" if k not in meta else f"a {type(meta[k]).__name__}"
            raise InputError(f"{where}: metadata key {k!r} is {found}; expected a {t.__name__} (a file written by "
                             "this version of symgraph align: run it again)")
    if not isinstance(meta.get("similarity"), (str, type(None))):
        raise InputError(f"{where}: metadata key 'similarity' is a {type(meta['similarity']).__name__}; expected "
                         "a string")
    opts = meta["options"]
    if not isinstance(opts.get("fold_norms", True), bool) or not (
            opts.get("outputs") is None or (isinstance(opts["outputs"], list)
                                            and all(isinstance(o, str) for o in opts["outputs"]))):
        raise InputError(f"{where}: metadata 'options' is {json.dumps(opts)[:80]}; expected fold_norms a boolean "
                         "and outputs null or a list of names")
    return meta


def _structure(meta, side, where):
    """One side's saved structure, checked against its fingerprint: ``({group id: (kind,
    size, dim, blocks, outer)}, {parameter: shape}, [(gain, reader)])``."""
    text = meta[f"structure_{side}"]
    if _digest(text) != meta[f"fingerprint_{side}"]:
        raise InputError(f"{where}: metadata 'structure_{side}' does not match 'fingerprint_{side}'; expected "
                         "the record symgraph align wrote, unaltered")
    try:
        gs, shapes, folds = json.loads(text)
        table = {}

        def ints(*xs):
            return all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
        for gid, kind, size, dim, blocks, _params, _variance, outer in gs:
            if not (ints(gid, size, dim, blocks) and isinstance(kind, str) and isinstance(outer, list)
                    and ints(*outer)):
                raise ValueError(f"group entry {gid!r}")
            table[gid] = (kind, size, dim, blocks, outer)
        shapes = {n: tuple(sh) for n, sh in shapes}
        if not all(isinstance(n, str) and isinstance(sh, tuple) and ints(*sh) for n, sh in shapes.items()):
            raise ValueError("parameter shapes")
        folds = [(a, b) for a, b in folds]
        if not all(isinstance(a, str) and isinstance(b, (str, type(None))) for a, b in folds):
            raise ValueError("folds")
    except (ValueError, TypeError, RecursionError) as e:
        raise InputError(f"{where}: metadata 'structure_{side}' is malformed ({str(e)[:60]}); expected the "
                         "record symgraph align wrote") from None
    return table, shapes, folds


def _fibre(table, gid):
    """The sizes of a group's outer classes, when they are all saved and make up its blocks."""
    _, size, dim, blocks, outer = table[gid]
    sizes = [table[o][1] for o in outer if o in table]
    return tuple(sizes) if len(sizes) == len(outer) and math.prod(sizes) == blocks else None

def _plan(header, kinds, groups, shapes, folds, where):
    """``[(group id, saved kind)]``, refused unless every tensor in the file is one that the
    metadata names (an element of a group of B, or A's gain of a fold) and every named element
    has its tensors, of the dtypes and ranks they are saved in."""
    plan, used = [], set()
    for gid, kind in kinds.items():
        try:
            g = int(gid)
        except (TypeError, ValueError):
            g = None
        if g is None or str(g) != gid:
            raise InputError(f"{where}: element id {gid!r} is not a group id; expected the integer ids of "
                             "B's symmetry groups")
        if g not in groups:
            raise InputError(f"{where}: element {gid} names group {gid}, which model B does not have (its groups are "
                             f"0..{max(groups, default=-1)}); expected elements of B's groups only")
        if kind not in _SAVED_KINDS:
            raise InputError(f"{where}: element {gid} is saved as {kind!r}; expected one of "
                             f"{', '.join(_SAVED_KINDS)}")
        keys = {"perm": [".index"], "map": [".co", ".contra"]}.get(kind, [""])
        for suffix in keys:
            key = f"element.{gid}{suffix}"
            if key not in header:
                raise InputError(f"{where}: element {gid} ({kind}) has no tensor {key!r}; expected every element "
                                 "the metadata lists to be in the file")
            dt, shape = header[key]
            if dt not in SAFETENSORS_DTYPES:
                raise InputError(f"{where}: tensor {key!r} has dtype {dt}; expected "
                                 f"{'an integer' if kind == 'perm' else 'a floating-point'} dtype")
            check_element_shape(shape, groups[g], stored=kind, where=where)
            used.add(key)
        plan.append((g, kind))
    gains = {n for f in folds for n in f if n}
    for key, (dt, shape) in header.items():
        if key in used:
            continue
        name = key.removeprefix("gauge.")
        if key.startswith("gauge.") and name in gains:
            if tuple(shape) != shapes.get(name):
                raise InputError(f"{where}: gauge tensor {name!r} has shape {shape}; expected "
                                 f"{list(shapes.get(name, ()))} "
                                 "(model A's norm gain)")
            continue
        raise InputError(f"{where}: tensor {key!r} is not an element the metadata lists nor a folded norm's gain; "
                         "expected only the tensors symgraph align writes")
    return plan


ALIGNMENT_FILE = "symgraph_alignment.safetensors"

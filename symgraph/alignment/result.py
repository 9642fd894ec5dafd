"""The result of :func:`symgraph.align`: one element or transport map per class, keyed by group
id (the same id names a class in A's and B's reports), with the means to apply it."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import torch

from ..transform.apply import check_model, move, stored_tensors, write_state
from ..core.elements import Map, Perm
from ..errors import InputError
from ..report.api import analyze
from ..report.symmetry import SymmetryReport
from ..core.finite import require_module
from .checks import check_finite
from .saved import fingerprint, read_alignment, save_alignment

__all__ = ["Alignment", "load_alignment"]


@dataclass
class Alignment:
    """Group elements / transport maps carrying B's classes into A's basis.

    ``elements[group_id]``: a ``[*fibres, n_A, n_B]`` tensor, a :class:`~symgraph.core.elements.Perm`
    (unfibred permutation as indices) or a :class:`~symgraph.core.elements.Map` (rectangular or soft
    map). ``results[group_id]``: the solver's :class:`~symgraph.solve.SolveResult`. ``scales``:
    per-head scalars fitted by ``rescale=True``. ``seconds``: analyze / solver / total time.
    Where the reports fold norm gains (``report.folds``), B is folded, moved and unfolded into
    A's gains (``gauge``): the result has A's gains and shifts and B's function.
    """
    report_a: SymmetryReport | None  # None: a loaded alignment without its models' reports
    report_b: SymmetryReport | None
    elements: dict
    results: dict = field(default_factory=dict)
    similarity: str = "weights"
    seconds: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)
    template: object = field(default=None, repr=False)  # A's model: the shapes of a fused result
    gauge: dict = field(default_factory=dict, repr=False)  # A's folded norm gains and shifts
    refined: dict = field(default_factory=dict)  # what refine did (steps, losses, seconds)
    full_groups: dict = field(default_factory=dict)  # what fit_gl kept per gl/rope class
    shared: dict = field(default_factory=dict)  # how processes shared the solves (.shared.Waves.summary)
    options: dict = field(default_factory=dict)  # the analysis options (fold_norms, outputs) B's report used
    fingerprints: dict = field(default_factory=dict)  # a loaded alignment's {"a", "b"}: see saved.fingerprint
    structures: dict = field(default_factory=dict, repr=False)  # a loaded alignment's {"a", "b"}: saved.structure

    def report_for(self, model_b):
        """B's report, or for a loaded alignment (no reports) ``model_b``'s, analysed with the
        saved options and refused unless its symmetry structure is B's."""
        if self.report_b is not None:
            check_model(self.report_b, model_b, "model_b")
            return self.report_b
        rep = analyze(model_b, fold_norms=self.options.get("fold_norms", True), outputs=self.options.get("outputs"))
        if self.fingerprints.get("b") and fingerprint(rep) != self.fingerprints["b"]:
            raise InputError(f"the model ({type(model_b).__name__}) has another symmetry structure than the "
                             "model B this alignment was solved for (another architecture, width or config); "
                             "expected a model of B's architecture and shapes, e.g. a fine-tune of B")
        return rep

    def save(self, path: str) -> str:
        """Write this alignment into ``path`` (a ``.safetensors`` file); see
        :func:`symgraph.load_alignment`."""
        return save_alignment(self, path)

    def state(self, model_b) -> dict:
        """B's parameters and moved buffers (``report_b.buffers``: running statistics) in A's
        basis (and A's shapes): ``{fqn: tensor}`` in B's dtypes."""
        return self._state(model_b, self.report_for(model_b))

    def _state(self, model_b, rb) -> dict:
        tensors = stored_tensors(rb, model_b, check=self.report_b is None)
        moved = move(rb, self.elements, tensors, self.gauge or None, cast={k: t.dtype for k, t in tensors.items()})
        out = {k: moved[k] if k in moved else t.clone() for k, t in tensors.items()}
        for keep, others in rb.aliases.items():  # tied names share the value
            for o in others:
                out[o] = out[keep]
        return out

    def apply(self, model_b, template=None):
        """A new model computing B's function (exactly, for group elements) in A's basis.

        ``model_b`` is not modified. When widths differ the result has A's architecture
        (``template``, default: the anchor model given to :func:`align`).
        """
        require_module(model_b, "model_b")
        check_finite(model_b, "model_b")
        rb = self.report_for(model_b)
        state = self._state(model_b, rb)
        own = {**dict(model_b.named_parameters(remove_duplicate=False)), **dict(model_b.named_buffers())}
        shapes_same = all(tuple(own[k].shape) == tuple(v.shape) for k, v in state.items())
        base = template if template is not None else (model_b if shapes_same else self.template)
        new = copy.deepcopy(base)
        write_state(new, state, rb.buffers)
        if base is not model_b:  # carry over B's parameters and buffers no class touched
            mine = {**dict(new.named_parameters()), **dict(new.named_buffers())}
            with torch.no_grad():
                for k, p in own.items():
                    if k not in state and k in mine and tuple(mine[k].shape) == tuple(p.shape):
                        mine[k].copy_(p)
        return new

    def to_dict(self) -> dict:
        """A JSON-able summary: per group its kind, solver status and objective, and the
        element itself for permutations (index lists)."""
        groups = []
        for g in (self.report_a.groups if self.report_a is not None else ()):
            el, res = self.elements.get(g.id), self.results.get(g.id)
            entry = {"id": g.id, "module": g.module, "kind": g.kind, "aligned": el is not None}
            if res is not None:
                entry |= {"status": res.status, "objective": float(res.objective)}
            if isinstance(el, Perm):
                entry["permutation"] = el.index.tolist()
            elif isinstance(el, Map):
                entry["map_shape"] = list(el.shape)
            if g.id in self.scales:
                entry["scales"] = list(self.scales[g.id])
            groups.append(entry)
        return {"similarity": self.similarity, "seconds": dict(self.seconds),
                "refined": dict(self.refined), "groups": groups}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))


def load_alignment(path: str) -> Alignment:
    """The alignment saved in ``path`` (a file from :meth:`Alignment.save`, or a directory
    ``symgraph align`` wrote), every element checked against its group as it is read
    (:func:`~symgraph.alignment.saved.read_alignment`). Its reports are None:
    :meth:`Alignment.apply` analyses the model it is given and refuses one whose symmetry
    structure differs from B's (another architecture or width)."""
    return Alignment(**read_alignment(path))

"""The symmetry report: groups, frozen ops, elements, certificates, pictures."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

from .errors import CertificationError, InputError
from .groups import orthogonal_part, sample
from .trace import eval_mode, split_inputs


@dataclass
class Group:
    """One symmetry group of the model: a class of axes that transform together.

    ``size`` is the number of coordinates it acts on (``blocks × dim``); ``blocks`` > 1 for a
    head-structured class whose element is chosen independently per head (``outer`` lists the
    head groups it is fibred over); ``params`` lists ``(param_name, dim)`` slots and
    ``variance`` whether each takes ``g`` ("co") or ``g^{-T}`` ("contra").
    """
    id: int
    kind: str
    size: int
    dim: int
    blocks: int
    module: str
    params: list
    variance: list
    outer: list = field(default_factory=list)
    pairs: tuple | None = None
    root: int = -1

    @property
    def dof(self) -> int:
        """Continuous degrees of freedom (0 for discrete groups)."""
        n = self.dim
        per = {"gl": n * n, "orthogonal": n * (n - 1) // 2, "rope": len(self.pairs or ()),
               "scaled_perm": n}.get(self.kind, 0)
        return per * self.blocks

    def to_dict(self):
        return {"id": self.id, "kind": self.kind, "size": self.size, "dim": self.dim,
                "blocks": self.blocks, "module": self.module, "outer": self.outer,
                "params": [[p, d] for p, d in self.params], "variance": self.variance,
                "dof": self.dof}


@dataclass
class Transform:
    """One group element per group: ``elements[root]`` is ``[*fibre_sizes, n, n]`` float64."""
    report: "SymmetryReport"
    elements: dict

    def element(self, group: Group) -> torch.Tensor:
        return self.elements[group.root]


def _common_prefix(names):
    parts = [n.split(".")[:-1] for n in names]
    if not parts:
        return ""
    out = []
    for seg in zip(*parts):
        if all(s == seg[0] for s in seg):
            out.append(seg[0])
        else:
            break
    return ".".join(out)


def _flatten_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict) or hasattr(out, "items"):
        return [t for v in out.values() for t in _flatten_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flatten_outputs(v)]
    return []


def _to64(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _to64(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to64(v) for v in x)
    return x


class SymmetryReport:
    """What ``symgraph.analyze`` found: every weight-space symmetry the graph admits."""

    def __init__(self, analysis, model_name: str, inputs):
        self._analysis = analysis
        self.model_name = model_name
        self._inputs = inputs
        self.groups: list[Group] = []
        self.frozen = analysis.frozen
        self._build()

    # --- construction --------------------------------------------------------------------
    def _build(self):
        an = self._analysis
        uf = an.uf
        slots: dict[int, list] = {}
        for name, node in an.param_nodes.items():
            for d, a in enumerate(an.node_axes[node]):
                for leaf, par in _leaves_par(an, a, 0):
                    slots.setdefault(leaf, []).append((name, d, "contra" if par else "co"))
        roots = [r for r in slots if an.kind(r) != "identity" and uf.size[r] > 1]
        # order groups by first appearance among parameters (model order)
        order = {}
        for i, (name, node) in enumerate(an.param_nodes.items()):
            for a in an.node_axes[node]:
                for leaf, _ in _leaves_par(an, a, 0):
                    order.setdefault(leaf, i)
        roots.sort(key=lambda r: (order.get(r, 0), r))
        ids = {r: i for i, r in enumerate(roots)}
        for r in roots:
            fib = an.fibre.get(r, ())
            blocks = math.prod(uf.size[f] for f in fib) if fib else 1
            names = sorted({s[0] for s in slots[r]})
            self.groups.append(Group(
                id=ids[r], kind=an.kind(r), size=uf.size[r] * blocks, dim=uf.size[r],
                blocks=blocks, module=_common_prefix(names),
                params=[(s[0], s[1]) for s in slots[r]], variance=[s[2] for s in slots[r]],
                outer=[ids[f] for f in fib if f in ids], pairs=uf.pairs.get(r), root=r))
        self._by_root = {g.root: g for g in self.groups}

    # --- queries -------------------------------------------------------------------------
    def by_module(self, prefix: str):
        return [g for g in self.groups if g.module.startswith(prefix)]

    def group_of(self, param: str, dim: int):
        """Groups acting on ``param``'s dimension ``dim``."""
        return [g for g in self.groups if (param, dim) in g.params]

    @property
    def degrees_of_freedom(self) -> int:
        return sum(g.dof for g in self.groups)

    # --- group elements ------------------------------------------------------------------
    def random_transform(self, seed: int = 0, orthogonal: bool = False) -> Transform:
        """One random element of every group (``orthogonal=True``: from its orthogonal part)."""
        gen = torch.Generator().manual_seed(seed)
        an = self._analysis
        elements = {}
        for g in self.groups:
            kind = orthogonal_part(g.kind) if orthogonal else g.kind
            fib = an.fibre.get(g.root, ())
            batch = tuple(an.uf.size[f] for f in fib)
            elements[g.root] = sample(kind, g.dim, gen, batch=batch, pairs=g.pairs)
        return Transform(self, elements)

    def identity_transform(self) -> Transform:
        return Transform(self, {})

    def certify(self, model, inputs=None, trials: int = 3, tol: float = 1e-6) -> float:
        """Apply random elements of every group in float64; return the worst relative change.

        Raises :class:`CertificationError` when it exceeds ``tol``.
        """
        from .transform import transform
        if any(p.is_meta for p in model.parameters()):
            raise InputError("cannot certify a model on the meta device: it has no weights")
        args, kwargs = split_inputs(model, inputs) if inputs is not None else self._inputs
        m64 = copy.deepcopy(model).double()
        args, kwargs = _to64(args), _to64(kwargs)
        with torch.no_grad(), eval_mode(m64):
            base = _flatten_outputs(m64(*args, **kwargs))
            worst = 0.0
            for trial in range(trials):
                mt = transform(m64, self.random_transform(seed=trial))
                with eval_mode(mt):
                    out = _flatten_outputs(mt(*args, **kwargs))
                for a, b in zip(base, out):
                    rel = (a - b).norm().item() / max(a.norm().item(), 1e-30)
                    worst = max(worst, rel)
        if worst > tol:
            raise CertificationError(
                f"symmetry certificate failed for {self.model_name}: transformed outputs differ "
                f"by {worst:.3g} (relative), expected at most {tol:g}")
        return worst

    # --- presentation --------------------------------------------------------------------
    def summary(self) -> str:
        lines = [f"Symmetry report for {self.model_name}: {len(self.groups)} groups, "
                 f"{self.degrees_of_freedom} continuous degrees of freedom, "
                 f"{len(self.frozen)} ops without a rule"]
        hdr = f"{'id':>4}  {'module':<40} {'kind':<12} {'size':>6} {'blocks':>6} {'outer':<8} params"
        lines += [hdr, "-" * len(hdr)]
        for g in sorted(self.groups, key=lambda g: (g.module, g.id)):
            names = sorted({p for p, _ in g.params})
            shown = ", ".join(n[len(g.module) + 1:] if g.module else n for n in names[:4])
            more = f" (+{len(names) - 4})" if len(names) > 4 else ""
            lines.append(f"{g.id:>4}  {(g.module or '(model)'):<40.40} {g.kind:<12} {g.size:>6} "
                         f"{g.blocks:>6} {','.join(map(str, g.outer)) or '-':<8} {shown}{more}")
        if self.frozen:
            lines.append("")
            lines.append("Frozen by ops without a rule (their axes are fixed):")
            for f in self.frozen:
                lines.append(f"  {f.op} at {f.node} in {f.module or '<root>'}  {f.source}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<SymmetryReport {self.model_name}: {len(self.groups)} groups>"

    def to_dict(self):
        return {"model": self.model_name, "groups": [g.to_dict() for g in self.groups],
                "frozen": [f.to_dict() for f in self.frozen],
                "degrees_of_freedom": self.degrees_of_freedom}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))

    def to_networkx(self):
        """The transport-map flow: groups as nodes, parameters as edges between them."""
        import networkx as nx
        G = nx.MultiDiGraph()
        for g in self.groups:
            G.add_node(g.id, kind=g.kind, size=g.size, blocks=g.blocks, module=g.module,
                       label=f"{g.id}: {g.kind} {g.size}" + (f" ({g.blocks} heads)" if g.blocks > 1 else ""))
        by_param: dict = {}
        for g in self.groups:
            for (p, d), v in zip(g.params, g.variance):
                by_param.setdefault(p, set()).add((d, g.id))
        for p, entries in by_param.items():
            outs = {gid for d, gid in entries if d == 0}
            ins = {gid for d, gid in entries if d != 0}
            for a in ins:
                for b in outs:
                    if a != b:
                        G.add_edge(a, b, param=p)
            if not ins or not outs:
                for gid in ins | outs:
                    G.nodes[gid].setdefault("params", []).append(p)
        return G

    def to_dot(self) -> str:
        G = self.to_networkx()
        colors = {"perm": "lightblue", "scaled_perm": "lightcyan", "signed_perm": "lavender",
                  "orthogonal": "palegreen", "gl": "gold", "rope": "salmon"}
        lines = ["digraph symmetry {", "  rankdir=LR; node [shape=box, style=filled];"]
        for n, d in G.nodes(data=True):
            lab = d["label"] + (f"\\n{d['module']}" if d["module"] else "")
            lines.append(f'  g{n} [label="{lab}", fillcolor="{colors.get(d["kind"], "white")}"];')
        for a, b, d in G.edges(data=True):
            lines.append(f'  g{a} -> g{b} [label="{d["param"].split(".")[-2] if "." in d["param"] else d["param"]}", fontsize=8];')
        lines.append("}")
        return "\n".join(lines)

    def save_graph(self, path: str) -> str:
        """Write the class graph to ``.dot``, ``.png`` or ``.svg`` (atomically)."""
        ext = os.path.splitext(path)[1].lower()
        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=d, suffix=ext)
        os.close(fd)
        try:
            if ext == ".dot":
                with open(tmp, "w") as f:
                    f.write(self.to_dot())
            elif ext in (".png", ".svg"):
                if shutil.which("dot"):
                    subprocess.run(["dot", f"-T{ext[1:]}", "-o", tmp], input=self.to_dot(),
                                   text=True, check=True)
                else:
                    self._draw_matplotlib(tmp)
            else:
                raise InputError(f"unknown graph format {ext!r}: expected .dot, .png or .svg")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a picture is an ordinary file
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def _draw_matplotlib(self, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import networkx as nx
        G = self.to_networkx()
        fig, ax = plt.subplots(figsize=(max(8, len(G) * 0.35), 8))
        try:
            pos = nx.kamada_kawai_layout(G) if len(G) > 1 else nx.spring_layout(G)
        except Exception:  # noqa: BLE001 - layout is cosmetic
            pos = nx.spring_layout(G, seed=0)
        colors = {"perm": "#9cc9f0", "scaled_perm": "#c7eef0", "signed_perm": "#dcd0f5",
                  "orthogonal": "#a8e6a1", "gl": "#f5d76e", "rope": "#f4a48f"}
        nx.draw_networkx(G, pos, ax=ax, node_color=[colors.get(G.nodes[n]["kind"], "#ddd") for n in G],
                         labels={n: G.nodes[n]["label"] for n in G}, font_size=6, node_size=600,
                         arrowsize=8)
        ax.set_title(f"symmetry classes of {self.model_name}")
        ax.axis("off")
        fig.savefig(path, dpi=120, bbox_inches="tight", format=os.path.splitext(path)[1][1:])
        plt.close(fig)


def _leaves_par(an, axis, par):
    r, p = an.uf.find(axis)
    p ^= par
    s = an.uf.struct.get(r)
    if s is None:
        return [(r, p)]
    out = []
    for a, pa in s[1]:
        out += _leaves_par(an, a, pa ^ p)
    return out

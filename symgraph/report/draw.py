"""Pictures of a report: the transport-map flow as a networkx graph, Graphviz dot, PNG/SVG."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ..errors import InputError
from ..core.files import identity, remove_own

__all__ = ["summary", "to_networkx", "to_dot", "save_graph"]


def summary(report) -> str:
    """The text of :meth:`SymmetryReport.summary`."""
    lines = [f"Symmetry report for {report.model_name}: {len(report.groups)} groups, "
             f"{report.degrees_of_freedom} continuous degrees of freedom, "
             f"{sum(f.why == 'no rule' for f in report.frozen)} ops without a rule"
             + "".join(f", {n} ops whose rule failed" for n in [sum(f.why != 'no rule' for f in report.frozen)] if n)]
    if getattr(report, "unread", None):
        lines.append(f"Every parameter stays fixed: {report.unread}")
    dead = list(getattr(report, "dead_parameters", {}).items())
    lines += [f"{name} alone stays fixed: {why}" for name, why in dead[:6]]
    lines += [f"(and {len(dead) - 6} more parameters no method reads)"] if len(dead) > 6 else []
    w = max([len("module")] + [len(g.module or "(model)") for g in report.groups])
    hdr = f"{'id':>4}  {'module':<{w}} {'kind':<12} {'size':>6} {'blocks':>6} {'outer':<8} params"
    lines += [hdr, "-" * len(hdr)]
    for g in sorted(report.groups, key=lambda g: (g.module, g.id)):
        names = sorted({p for p, _ in g.params})
        shown = ", ".join(n[len(g.module) + 1:] if g.module else n for n in names[:4])
        more = f" (+{len(names) - 4})" if len(names) > 4 else ""
        lines.append(f"{g.id:>4}  {(g.module or '(model)'):<{w}} {g.kind:<12} {g.size:>6} "
                     f"{g.blocks:>6} {','.join(map(str, g.outer)) or '-':<8} {shown}{more}")
    lines.append("size: coordinates acted on (blocks x per-block size); blocks: independent copies of the "
                 "element (one per head); outer: the ids of the classes it is fibred over (its heads)")
    for gid, why in report.shared.items():
        lines.append(f"group {gid}: {why}")
    if report.buffers:
        lines += ["", f"{len(report.buffers)} buffers move with their groups: "
                  + ", ".join(report.buffers[:6]) + (" ..." if len(report.buffers) > 6 else "")]
    if report.folds:
        lines.append("")
        lines.append(f"{len(report.folds)} norm gains fold into the layers that read them "
                     "(transforms fold, move and unfold; analyze(..., fold_norms=False) keeps "
                     "residual streams permutations):")
        for f in report.folds:
            readers = ", ".join(w for w, _, _ in f.readers)
            lines.append(f"  {f.gain} -> {readers}")
    if report.frozen:
        lines.append("")
        lines.append("Frozen ops (their axes are fixed):")
        for f in report.frozen:
            why = "" if f.why == "no rule" else f"  [{f.why}: a symgraph rule bug, please report it]"
            lines.append(f"  {f.op} at {f.node} in {f.module or '<root>'}  {f.source}{why}")
    return "\n".join(lines)


def to_networkx(report):
    """The transport-map flow: groups as nodes, parameters as edges between them."""
    import networkx as nx
    G = nx.MultiDiGraph()
    for g in report.groups:
        G.add_node(g.id, kind=g.kind, size=g.size, blocks=g.blocks, module=g.module,
                   label=f"{g.id}: {g.kind} {g.size}" + (f" ({g.blocks} heads)" if g.blocks > 1 else ""))
    by_param: dict = {}
    for g in report.groups:
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

def to_dot(report) -> str:
    G = to_networkx(report)
    colors = {"perm": "lightblue", "scaled_perm": "lightcyan", "signed_perm": "lavender",
              "orthogonal": "palegreen", "orthogonal_mean": "honeydew", "gl": "gold",
              "rope": "salmon"}
    lines = ["digraph symmetry {", "  rankdir=LR; node [shape=box, style=filled];"]
    for n, d in G.nodes(data=True):
        lab = d["label"] + (f"\\n{d['module']}" if d["module"] else "")
        lines.append(f'  g{n} [label="{lab}", fillcolor="{colors.get(d["kind"], "white")}"];')
    for a, b, d in G.edges(data=True):
        lines.append(f'  g{a} -> g{b} [label="{d["param"].split(".")[-2] if "." in d["param"] else d["param"]}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines)

def save_graph(report, path: str) -> str:
    """Write the class graph to ``.dot``, ``.png`` or ``.svg`` (atomically)."""
    ext = os.path.splitext(path)[1].lower()
    d = os.path.dirname(os.path.abspath(path))
    prefix = ".symgraph-tmp-"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=prefix, suffix=ext)
    made = identity(tmp)
    os.close(fd)
    try:
        if ext == ".dot":
            with open(tmp, "w") as f:
                f.write(to_dot(report))
        elif ext in (".png", ".svg"):
            dot = shutil.which("dot")
            if dot:
                _run_dot(dot, ext[1:], tmp, to_dot(report), path)
            else:
                _draw_matplotlib(report, tmp)
        else:
            raise InputError(f"unknown graph format {ext!r}: expected .dot, .png or .svg")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a picture is an ordinary file
        try:  # a hard link never replaces a file that appeared at ``path`` since it was checked
            os.link(tmp, path)
        except FileExistsError:
            raise InputError(f"{path!r} appeared while the graph was drawn; symgraph never replaces a file "
                             "it did not write; expected a new file name") from None
        except OSError:  # a file system without hard links
            os.replace(tmp, path)
    finally:
        # the only deletion: this call's mkstemp file, if still there (renamed onto ``path``
        # on success)
        remove_own(tmp, made, prefix)
    return path

#: Seconds Graphviz may take to draw a report's graph (a few hundred nodes take well under one).
DOT_SECONDS = 120


def _run_dot(dot: str, fmt: str, tmp: str, text: str, path: str) -> None:
    """Graphviz ``dot`` draws ``text`` as ``fmt`` into ``tmp``; one that fails (no PNG support,
    not executable), hangs or writes nothing is refused in one line naming it and its message."""
    why = None
    try:
        r = subprocess.run([dot, f"-T{fmt}", "-o", tmp], input=text, text=True, capture_output=True,
                           timeout=DOT_SECONDS)
    except subprocess.TimeoutExpired:
        why = f"ran over {DOT_SECONDS} s"
    except OSError as e:
        why = f"could not run ({e.strerror or type(e).__name__})"
    else:
        said = " ".join((r.stderr or r.stdout or "").split())[:200]
        if r.returncode != 0:
            why = f"exited with status {r.returncode}" + (f": {said}" if said else "")
        elif os.path.getsize(tmp) == 0:
            why = "wrote nothing" + (f" ({said})" if said else "")
    if why is not None:
        raise InputError(f"cannot draw {path!r}: Graphviz {dot!r} -T{fmt} {why}; expected a Graphviz that writes "
                         f"{fmt.upper()} (check `dot -T{fmt}`), or write --dot FILE.dot and draw it yourself")


KIND_NAMES = {"perm": "permutation", "scaled_perm": "scaled permutation", "signed_perm": "signed permutation",
              "orthogonal": "orthogonal", "orthogonal_mean": "orthogonal fixing the mean",
              "gl": "GL (any invertible)", "rope": "RoPE pair rotations"}


def _short(module: str, parts: int = 3) -> str:
    """The last ``parts`` components of a module path (``layer.1.attention.self``)."""
    return ".".join(module.split(".")[-parts:]) if module else "(model)"


def _draw_matplotlib(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.patches import Patch
    G = to_networkx(report)
    fig, ax = plt.subplots(figsize=(max(9, len(G) * 0.45), 9))
    try:
        pos = nx.kamada_kawai_layout(G) if len(G) > 1 else nx.spring_layout(G)
    except Exception:  # noqa: BLE001 - layout is cosmetic
        pos = nx.spring_layout(G, seed=0)
    colors = {"perm": "#9cc9f0", "scaled_perm": "#c7eef0", "signed_perm": "#dcd0f5",
              "orthogonal": "#a8e6a1", "orthogonal_mean": "#d4f2cf", "gl": "#f5d76e",
              "rope": "#f4a48f"}
    labels = {n: f"{n}: {d['kind']} {d['size']}" + (f" ({d['blocks']} heads)" if d["blocks"] > 1 else "")
              + f"\n{_short(d['module'])}" for n, d in G.nodes(data=True)}
    nx.draw_networkx(G, pos, ax=ax, node_color=[colors.get(G.nodes[n]["kind"], "#ddd") for n in G],
                     labels=labels, font_size=6, node_size=900, arrowsize=8, edge_color="#888")
    kinds = sorted({d["kind"] for _, d in G.nodes(data=True)})
    ax.legend(handles=[Patch(color=colors.get(k, "#ddd"), label=KIND_NAMES.get(k, k)) for k in kinds],
              title="group kind (node: id: kind size, module)", loc="upper left", fontsize=7,
              title_fontsize=7, frameon=True)
    ax.set_title(f"symmetry classes of {report.model_name}: {len(G)} groups; an arrow A→B is a "
                 "parameter whose input axis is in A and output axis in B", fontsize=9)
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight", format=os.path.splitext(path)[1][1:])
    plt.close(fig)

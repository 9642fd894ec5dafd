"""``compare(a, b)``: is model B a copy of model A, up to every symmetry the graph admits?

B is aligned to A (by weights, or activations when ``data`` is given, with the full groups the
report claims), and each parameter of B-in-A's-basis is compared with A's: the relative
Frobenius distance ``‖A − B′‖ / ‖A‖``, the cosine and the correlation (the cosine of the
centred tensors). One verdict comes out of it:

* ``"same"``: every tensor within a tolerance tied to the dtype (:data:`SAME_TOL`) — B is A
  moved by a group element (the alignment says which kinds);
* ``"derived"``: B's weight matrices (:func:`evidence`: a matrix keeps its initialisation, a
  vector comes out alike from the same data) stand out from a null: B with the entries of each
  tensor shuffled (its values, no longer its structure; :func:`shuffled`, seeded per tensor),
  aligned to A the same way ``null`` times. Each matrix's ``excess = (c − μ₀) / (1 − μ₀)`` is
  where its correlation ``c`` after alignment lies between its own null level ``μ₀`` (0: the
  mean over the shuffled copies; a large matrix aligned by continuous groups correlates with
  noise) and A itself (1); the verdict's excess is their median. ``"derived"`` when it is at
  least ``threshold`` (:data:`THRESHOLD`, chosen from trained independent and derived pairs of
  three families: ``benchmarks/bench_provenance_calibration.py``) and the normal tail of
  ``(s − μ₀) / σ₀`` of ``s``, the median correlation, against its null draws is below ``alpha``;
* ``"unrelated"`` otherwise;
* ``"undetermined"`` when B is not a copy and no null was drawn (``null=0``): without a null
  level and a p-value the rule can say neither "derived" nor "unrelated".

Models of one architecture whose widths differ (MLP units, heads, a residual stream that is a
class) are compared through the alignment's transport maps: B, and each shuffled copy of the
null, is carried into A's shapes (:meth:`Alignment.state`) and measured there; the verdict is
then at most "derived" (a map between widths is no group element). Shapes that differ along an
axis no class maps (a vocabulary, a head size) are refused in one line naming the tensor.

Tensors that take A's values by construction (norm gains folded into their readers: the
alignment's gauge) are listed but carry no evidence. Layers are read from the parameter
names (the prefix up to the first index of a module list, else the module), not from a table.

:func:`judge` gives the verdict from any way of solving and reading B in A's basis: :func:`compare`
holds both models in memory; ``symgraph compare`` on two checkpoints may run it out of core
(:func:`symgraph.cli.compare.compare_checkpoints`), with the same numbers.
"""
from __future__ import annotations

import copy
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field, StrictInt

from ..core.schema import Number
from ..core.finite import batch_list, require_module
from ..core.ties import untied_to_match
from ..errors import InputError, StructureMismatchError
from ..report.api import analyze
from ..core.progress import bar
from .checks import check_compatible
from .driver import align
from .result import Alignment

__all__ = ["compare", "Comparison", "SAME_TOL", "THRESHOLD", "tolerance", "layer_of", "judge", "measure", "evidence",
           "shuffled", "gauge_names", "check_options", "shape_differences", "check_widths", "width_refusal",
           "check_aligned"]

#: Relative Frobenius distance under which a tensor counts as equal, by the coarser dtype.
SAME_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: ``excess`` at or above which B is "derived" from A (see the module docstring).
THRESHOLD = 0.29
#: The one-sided p-value below which a "derived" verdict is given.
ALPHA = 1e-3
#: The most shuffled copies a null draws (each is one more alignment of a whole model).
MAX_NULL = 1000
NULL_DRAWS = Number(Annotated[StrictInt, Field(ge=0, le=MAX_NULL)],
                    f"a number of shuffled copies, an integer from 0 to {MAX_NULL}")
_SIGMA_FLOOR = 0.01  # σ₀ from a few null draws is noisy: never trust it below this


def tolerance(*dtypes) -> float:
    """The "same" tolerance of the coarsest of ``dtypes`` (1e-5 for float32)."""
    return max(SAME_TOL.get(d, 1e-5) for d in dtypes)


def layer_of(name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; ``lm_head.weight`` -> ``lm_head``."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


@dataclass
class Comparison:
    """What :func:`compare` found. ``tensors``: one dict per parameter (``name``, ``layer``,
    ``shape``, ``rel_distance``, ``cosine``, ``correlation``, ``gauge``); ``layers``: per layer
    the median correlation and largest distance over its evidence tensors, and whether it
    carries the verdict; ``null``: the statistic of each shuffled copy; ``widths``: ``{name:
    (A's shape, B's shape)}`` of the tensors whose widths differ (B was carried into A's shapes
    by the alignment's transport maps; the verdict is then at most "derived")."""
    verdict: str
    statistic: float
    excess: float
    p_value: float | None
    threshold: float
    tolerance: float
    max_rel_distance: float
    null: list
    tensors: list
    layers: list
    alignment: Alignment = field(repr=False)
    similarity: str = "weights"
    alpha: float = ALPHA
    mode: str = "in memory"  # or "out of core" (``symgraph compare`` on large checkpoints)
    widths: dict = field(default_factory=dict)  # {name: (A's shape, B's)} of the tensors whose widths differ
    untied: dict = field(default_factory=dict)  # {"A" or "B": the names it tied that the other stores apart}

    @property
    def null_mean(self) -> float:
        return float(sum(self.null) / len(self.null)) if self.null else 0.0

    @property
    def null_std(self) -> float:
        n = len(self.null)
        sd = math.sqrt(sum((x - self.null_mean) ** 2 for x in self.null) / (n - 1)) if n > 1 else 0.0
        return max(sd, _SIGMA_FLOOR)

    @property
    def carriers(self) -> list:
        return [r["layer"] for r in self.layers if r["carries"]]

    def group_kinds(self) -> dict:
        """``{kind: number of classes}`` the alignment filled."""
        out: dict = {}
        for g in (self.alignment.report_a.groups if self.alignment.report_a is not None else ()):
            if self.alignment.elements.get(g.id) is not None:
                out[g.kind] = out.get(g.kind, 0) + 1
        return out

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.group_kinds().items()))
        ev = evidence(self.tensors)
        n_ev = f"{len(ev)} {'weight matrices' if ev and len(ev[0]['shape']) >= 2 else 'tensors'}"
        p = "—" if self.p_value is None else f"{self.p_value:.2g}" if self.p_value > 0 else "< 1e-300"
        what = {"same": "B is A moved by a group element (to floating-point precision)",
                "derived": "B is closer to A than independently trained models get",
                "unrelated": "no evidence that B comes from A",
                "undetermined": "not a copy; telling derived from unrelated needs a null, and null=0 drew none"}[self.verdict]
        same = "widths differ: at most derived" if self.widths else f"same needs <= {self.tolerance:.0e}"
        lines = [f"verdict: {self.verdict} ({what})",
                 f"  max relative distance after alignment {self.max_rel_distance:.2e} ({same})",
                 f"  median correlation over {n_ev} {self.statistic:.3f}; "
                 + (f"null {self.null_mean:.3f} ± {self.null_std:.3f} from {len(self.null)} shuffled copies of B; "
                    if self.null else "no null drawn; ")
                 + f"excess {self.excess:.2f} (derived needs >= {self.threshold:g}), p {p}",
                 f"  aligned by {self.similarity} ({self.mode}): {kinds or 'no classes'}"]
        if self.widths:
            k, (x, y) = next(iter(self.widths.items()))
            more = len(self.widths) - 1
            lines.append(f"  widths differ in {len(self.widths)} tensors ({k} {list(x)} in A, {list(y)} in B"
                         + (f", and {more} more" if more else "") + "): B carried into A's shapes by the "
                         "transport maps")
        for side, names in self.untied.items():
            lines.append(f"  {side}'s tied parameters untied to compare ({', '.join(names)} stored apart in "
                         f"{'B' if side == 'A' else 'A'}: one function, the untied form)")
        if self.verdict not in ("unrelated", "undetermined"):
            car = self.carriers
            lines.append(f"  carried by {len(car)}/{len(self.layers)} layers"
                         + (f": {', '.join(car[:8])}{' …' if len(car) > 8 else ''}" if car else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "statistic": self.statistic, "statistic_name":
                "median over the weight matrices of the correlation (centred cosine) after alignment",
                "excess_name": "median over the weight matrices of (correlation - its null level) / "
                "(1 - its null level), each tensor's null level its mean over the shuffled copies",
                "excess": self.excess, "threshold": self.threshold, "p_value": self.p_value, "alpha": self.alpha,
                "null": list(self.null), "null_mean": self.null_mean, "null_std": self.null_std,
                "tolerance": self.tolerance, "max_rel_distance": self.max_rel_distance,
                "similarity": self.similarity, "mode": self.mode, "group_kinds": self.group_kinds(), "carriers": self.carriers,
                "widths": {k: [list(x), list(y)] for k, (x, y) in self.widths.items()}, "untied": self.untied,
                "layers": self.layers, "tensors": self.tensors, "alignment": self.alignment.to_dict()}

    def to_json(self, **kw) -> str:
        return json.dumps(_finite(self.to_dict()), **({"indent": 1} | kw))


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _check_pair(a, b) -> dict:
    """Refuse two models that are not one architecture (types, parameter names, tensor ranks);
    return ``{name: (A's shape, B's shape)}`` of the tensors whose widths differ (in A's order),
    which :func:`check_widths` checks once the models are analysed."""
    for m, label in ((a, "a"), (b, "b")):
        require_module(m, f"model {label}")
    if type(a) is not type(b):
        raise InputError(f"model A is a {type(a).__name__} but model B is a {type(b).__name__}; expected two "
                         "models of one architecture")
    return shape_differences({k: tuple(p.shape) for k, p in a.named_parameters()},
                             {k: tuple(p.shape) for k, p in b.named_parameters()})


def shape_differences(sa: dict, sb: dict, a: str = "models A and B") -> dict:
    """``{name: (A's shape, B's shape)}`` of the tensors of ``sa`` whose shapes differ in ``sb``;
    refuses a tensor that one side lacks or whose rank differs (another architecture)."""
    odd = sorted(k for k in set(sa) ^ set(sb)) + [k for k in sa if k in sb and len(sa[k]) != len(sb[k])]
    if odd:
        k = odd[0]
        raise InputError(f"{a} differ in tensor {k!r} ({sa.get(k, 'missing')} vs {sb.get(k, 'missing')}); "
                         "expected two models of one architecture")
    return {k: (tuple(sa[k]), tuple(sb[k])) for k in sa if tuple(sa[k]) != tuple(sb[k])}


def check_widths(ra, rb, widths: dict, a: str = "models A and B") -> None:
    """Refuse, in one line naming a tensor, models whose shapes (``widths``: from
    :func:`shape_differences`) differ along an axis that no class maps between widths (a
    vocabulary, a head size, anything :func:`~symgraph.alignment.checks.check_compatible`
    refuses)."""
    if not widths:
        return
    try:
        check_compatible(ra, rb)
    except StructureMismatchError as e:
        raise width_refusal(widths, e, a) from None


def width_refusal(widths: dict, e: Exception, a: str = "models A and B") -> InputError:
    """The one-line refusal of models whose widths differ where alignment found them
    incompatible (``e``): it names the tensor ``e`` names, else the first that differs."""
    name, (x, y) = next(((k, v) for k, v in widths.items() if repr(k) in str(e)), next(iter(widths.items())))
    return InputError(f"{a} differ in tensor {name!r} ({x} vs {y}), and alignment cannot map between these "
                      f"widths: {e}")


def check_aligned(name: str, got, want, a: str = "models A and B") -> None:
    """Refuse B's tensor ``name`` in A's basis when it did not come out in A's shape ``want``."""
    if tuple(got) != tuple(want):
        raise InputError(f"{a} differ in tensor {name!r} ({tuple(want)} vs {tuple(got)} after alignment) along "
                         "an axis that no symmetry class maps between widths; expected equal sizes there")


def check_options(null, threshold, said: str = "null=", alpha: float = ALPHA) -> None:
    """Refuse a ``null`` that is not a count of :data:`NULL_DRAWS` (``said``: how it was given), a
    ``threshold`` outside (0, 1] or an ``alpha`` (a p-value limit) outside (0, 1)."""
    NULL_DRAWS.check(null, said)
    for name, v, ok, want in (("threshold", threshold, lambda x: 0 < x <= 1, "(0, 1]"),
                              ("alpha", alpha, lambda x: 0 < x < 1, "(0, 1)")):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise InputError(f"{name}={v!r}; expected a number in {want}")


_CHUNK = 1 << 22  # entries per float64 slice of a tensor's statistics (32 MB a copy)


def _moments(x, y) -> tuple:
    """``(‖x−y‖², ‖x‖², ‖y‖², x·y, (x−x̄)·(y−ȳ), ‖x−x̄‖², ‖y−ȳ‖²)`` of two flat tensors, in
    float64 a slice at a time (two passes: the means, then the sums), so that a large tensor
    never has float64 copies of its whole."""
    n = x.numel()
    spans = [(i, min(i + _CHUNK, n)) for i in range(0, n, _CHUNK)]
    mx = my = 0.0
    for i, j in spans:
        mx += float(x[i:j].double().sum())
        my += float(y[i:j].double().sum())
    mx, my = mx / max(n, 1), my / max(n, 1)
    if n <= 1:
        mx = my = 0.0  # one entry: nothing to centre
    acc = [0.0] * 7
    for i, j in spans:
        a, b = x[i:j].double(), y[i:j].double()
        ac, bc = a - mx, b - my
        for k, v in enumerate(((a - b).square().sum(), a.square().sum(), b.square().sum(), a @ b,
                               ac @ bc, ac.square().sum(), bc.square().sum())):
            acc[k] += float(v)
    return tuple(acc)


def measure(read_a, read_b, names, gauge) -> list:
    """One row per parameter ``name`` (see :class:`Comparison`): A's tensor ``read_a(name)``
    against B's in A's basis ``read_b(name)``, read one name at a time."""
    rows = []
    for name in names:
        x = read_a(name).detach()
        y = read_b(name).detach()
        shape = list(x.shape)
        d2, a2, b2, ab, abc, ac2, bc2 = _moments(x.reshape(-1), y.reshape(-1))
        del x, y
        na, nb = math.sqrt(a2), math.sqrt(b2)
        rel = math.sqrt(d2) / max(na, nb, 1e-300) if max(na, nb) > 0 else 0.0
        cos = ab / (na * nb) if na > 0 and nb > 0 else float(na == nb)
        nxc, nyc = math.sqrt(ac2), math.sqrt(bc2)
        cor = abc / (nxc * nyc) if nxc > 0 and nyc > 0 else cos
        rows.append({"name": name, "layer": layer_of(name), "shape": shape,
                     "rel_distance": rel, "cosine": cos, "correlation": cor, "gauge": name in gauge})
    return rows


def _median(v) -> float:
    v = sorted(v)
    n = len(v)
    return float("nan") if n == 0 else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def evidence(rows) -> list:
    """The rows that carry evidence: the weight matrices (two or more dimensions) that are not
    gauge; all the rows that are not gauge where there is no matrix. A matrix keeps its random
    initialisation through training, which a copy inherits and an independent training does not;
    a vector (a bias, a norm's shift) starts from a constant, and the same data make it alike in
    independently trained models (``benchmarks/bench_provenance_calibration.py``)."""
    ev = [r for r in rows if not r["gauge"]]
    return [r for r in ev if len(r["shape"]) >= 2] or ev


def _statistic(rows) -> float:
    return _median([r["correlation"] for r in evidence(rows)])


def _tensor_excess(rows, null_rows) -> None:
    """Each row's ``null`` (its tensor's mean correlation over the shuffled copies: a large matrix
    aligned with continuous groups correlates with noise, a vector hardly) and ``excess``: where
    its correlation lies between that level (0) and A's own (1)."""
    levels: dict = {}
    for rs in null_rows:
        for r in rs:
            levels.setdefault(r["name"], []).append(r["correlation"])
    for r in rows:
        mu = sum(levels.get(r["name"], [0.0])) / len(levels.get(r["name"], [0.0]))
        r["null"], r["excess"] = mu, ((r["correlation"] - mu) / (1 - mu) if mu < 1 else 0.0)


def shuffled(t: torch.Tensor, seed: int, draw: int, name: str) -> torch.Tensor:
    """``t`` with its entries permuted at random: the permutation of shuffled copy ``draw`` of
    tensor ``name`` under ``seed`` (the same whether the tensor is read from a model or a
    checkpoint, in any order). Gathered by ``index_select``, which reads an int32 index as it
    is (indexing with ``[]`` makes an int64 copy of it first: 0.5 GB for a 1.1B model's LM
    head, twice the tensor's own bf16 size)."""
    key = zlib.crc32(f"{seed}:{draw}:{name}".encode())
    gen = torch.Generator().manual_seed(key)
    flat = t.detach().reshape(-1)
    perm = torch.randperm(flat.numel(), generator=gen, dtype=torch.int32 if flat.numel() < 2**31 else torch.int64)
    return flat.index_select(0, perm.to(flat.device)).reshape(t.shape)


def _shuffled_model(b, names, seed, draw):
    """A copy of ``b`` whose named tensors each have their entries permuted (:func:`shuffled`)."""
    out = copy.deepcopy(b)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(shuffled(params[n], seed, draw, n))
    return out


def gauge_names(report) -> set:
    """The parameters that take A's values by construction: norm gains folded into their
    readers (and their shifts, unless kept)."""
    return {n for f in report.folds for n in (f.gain, None if f.keep_shift else f.shift) if n}


def judge(solve, tol: float, *, null: int = 4, threshold: float = THRESHOLD, alpha: float = ALPHA,
          similarity: str = "weights", widths: dict | None = None) -> Comparison:
    """The verdict from ``solve(draw)``: ``(alignment, rows of measure)`` of B (``draw`` None)
    or of its ``draw``-th shuffled copy aligned to A (called in that order); ``tol``: the "same"
    tolerance; ``widths``: the tensors whose widths differ (then never "same"). What
    :func:`compare` runs in memory and ``symgraph compare`` out of core."""
    al, rows = solve(None)
    s = _statistic(rows)
    worst = max((r["rel_distance"] for r in rows if not r["gauge"]), default=0.0)
    same = worst <= tol and not widths
    null = 0 if same else null  # a copy needs no null
    null_rows = [solve(k)[1] for k in bar(range(null), desc="null (shuffled copies of B)", unit="draw")]
    null_s = [_statistic(rs) for rs in null_rows]
    res = Comparison("unrelated", s, 0.0, None, float(threshold), tol, worst, null_s, rows, [], al,
                     similarity=similarity, alpha=alpha, widths=dict(widths or {}))
    mu0 = res.null_mean
    _tensor_excess(rows, null_rows)
    res.excess = _median([r["excess"] for r in evidence(rows)])
    if null:
        z = (s - mu0) / res.null_std
        res.p_value = 0.5 * math.erfc(z / math.sqrt(2))
    if same:
        res.verdict = "same"
    elif not null:  # the rule needs a null's level and p-value: with no draw it tells neither way
        res.verdict = "undetermined"
    elif res.excess >= threshold and res.p_value is not None and res.p_value < alpha:
        res.verdict = "derived"
    by_layer: dict = {}
    for r in rows:
        by_layer.setdefault(r["layer"], []).append(r)
    for layer, rs in by_layer.items():
        ev = evidence(rs)
        ex = _median([r["excess"] for r in ev])
        # a layer carries only a verdict that B comes from A: none in "unrelated" or "undetermined"
        res.layers.append({"layer": layer, "tensors": len(ev), "correlation": _median([r["correlation"] for r in ev]),
                           "excess": ex, "rel_distance": max((r["rel_distance"] for r in ev), default=0.0),
                           "carries": bool(ev) and res.verdict in ("same", "derived") and ex >= threshold})
    return res


def compare(a, b, data=None, *, null: int = 4, threshold: float = THRESHOLD, alpha: float = ALPHA,
            seed: int = 0, inputs=None, fold_norms: bool = True) -> Comparison:
    """Is ``b`` a copy of ``a`` (``"same"``), derived from it (``"derived"``) or not
    (``"unrelated"``), up to every symmetry of their graph? See the module docstring.

    data : batches (as :func:`symgraph.align` takes them): align by activations; default weights.
    null : how many shuffled copies of B give the null (each one more alignment; 0: none, then
        only "same" can be told, anything else is "undetermined").
    threshold, alpha : the "derived" verdict's excess and p-value limits.

    Models of one architecture whose shapes differ only in the widths of classes (MLP units,
    heads, a residual stream that is a class) are compared through the alignment's transport
    maps: B is carried into A's shapes and measured there, and each shuffled copy likewise; the
    verdict is then at most "derived". Shapes that differ along an axis no class maps (a
    vocabulary, a head size) are refused, naming the tensor.
    """
    a, b, untied = untied_to_match(a, b)
    widths = _check_pair(a, b)
    check_options(null, threshold, alpha=alpha)
    data = batch_list(data, a, b)
    inputs = data[0] if inputs is None and data is not None else inputs
    ra = analyze(a, inputs, fold_norms=fold_norms)
    rb = analyze(b, inputs, fold_norms=fold_norms, outputs=ra.outputs)
    check_widths(ra, rb, widths)
    gauge = gauge_names(ra)
    a_state = {k: p for k, p in a.named_parameters() if p.is_floating_point()}
    names = list(a_state)
    evidence = [n for n in names if n not in gauge]

    def solve(draw):
        model_b = b if draw is None else _shuffled_model(b, evidence, seed, draw)
        al = align(a, model_b, data=data, report_a=ra, report_b=rb, full_groups=True)
        state = al.state(model_b)
        for n in names:
            check_aligned(n, state[n].shape, a_state[n].shape)
        return al, measure(a_state.__getitem__, state.__getitem__, names, gauge)

    dtypes = {p.dtype for p in a_state.values()} | {p.dtype for _, p in b.named_parameters() if p.is_floating_point()}
    res = judge(solve, tolerance(*dtypes), null=null, threshold=threshold, alpha=alpha,
                similarity="activations" if data is not None else "weights", widths=widths)
    res.untied = untied
    return res


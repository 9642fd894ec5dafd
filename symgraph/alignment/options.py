"""How :func:`~symgraph.alignment.driver.align` solves: :class:`AlignOptions`, one frozen pydantic
schema whose fields carry their type, default, range and description (the docstring under
each field). The types shared with the merge configuration (``Steps``, ``Columns``,
``Fraction``, ``Outputs``) are declared here once: :class:`symgraph.app.config.MergeConfig`
annotates its ``refine``, ``sketch``, ``tol``, ``outputs``, ``fold_norms`` and ``full_groups``
with them and takes their defaults from here, so the command line and the Python API accept
and refuse the same values. A refused value is an :class:`~symgraph.errors.InputError` of one
line naming the option, the value and what is expected (:mod:`symgraph.core.schema`)."""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

import torch
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator)

from ..core.schema import error_key, expected, refusal, short_repr
from ..errors import InputError
from .masses import Masses

__all__ = ["AlignOptions", "MAX_REFINE", "Steps", "Sweeps", "Columns", "Fraction", "Outputs"]

#: The most learned-matching steps an alignment takes (each a forward and backward pass over a batch).
MAX_REFINE = 1_000_000

#: A number of learned-matching steps.
Steps = Annotated[StrictInt, Field(ge=0, le=MAX_REFINE)]
#: The most sweeps of coordinate descent an alignment takes, and the most sketch columns.
MAX_SWEEPS, MAX_COLUMNS = 1000, 1 << 20
#: A number of sweeps of coordinate descent (at least one).
Sweeps = Annotated[StrictInt, Field(ge=1, le=MAX_SWEEPS)]
#: A number of sketch columns (0: none).
Columns = Annotated[StrictInt, Field(ge=0, le=MAX_COLUMNS)]
#: A relative gain in [0, 1).
Fraction = Annotated[StrictFloat, Field(ge=0, lt=1, allow_inf_nan=False)]
#: The outputs a symmetry must keep: names (keys of the model's output) or positions of a tuple output.
Outputs = Annotated[list[StrictStr | StrictInt], Field(min_length=1)] | None
#: A positive finite number.
Positive = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]


def _expects(text: str) -> Any:
    """A field's extra declaration: what a refusal says the field expects."""
    return {"expected": text}


class AlignOptions(BaseModel):
    """How :func:`~symgraph.alignment.driver.align` solves: pass one as ``options=``, or its fields
    as keywords of ``align`` and ``merge``. Frozen; every field is checked when it is built (a
    refused value raises :class:`~symgraph.errors.InputError` naming the field, the value and
    what it expects). Each field's meaning is the docstring under it (``model_fields[name].description``).
    """
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True,
                              use_attribute_docstrings=True)

    solver: Literal["hungarian", "ot", "sinkhorn"] | None = Field(
        None, json_schema_extra=_expects("None, 'hungarian', 'ot' or 'sinkhorn'"))
    """None (by group kind: Hungarian / Procrustes / RoPE / OT for different widths), "hungarian",
    "ot" (exact transport) or "sinkhorn" (soft maps with entropic ``reg``)."""
    inner: Literal["procrustes", "hungarian"] = Field(
        "procrustes", json_schema_extra=_expects("'procrustes' or 'hungarian'"))
    """"procrustes" (Zhang et al. 2024) or "hungarian" (Verma & Elbayad 2024) inside heads."""
    max_iter: Sweeps = Field(
        6, json_schema_extra=_expects(f"a number of sweeps (an integer >= 1, at most {MAX_SWEEPS})"))
    """At most this many sweeps of coordinate descent (weights); ``until`` may end them sooner.
    Nested head classes of a transformed copy converge slowly (1e-8 needs about 20 sweeps)."""
    until: Literal["exact", "discrete", "gap"] = Field("gap", json_schema_extra=_expects("'exact', 'discrete' or 'gap'"))
    """When the sweeps end before ``max_iter``. "gap" (default): from the second sweep on, once a
    sweep changes no discrete element (a permutation's order, a head matching, the pattern of a
    signed or scaled permutation, a transport plan) and none of its solves closes 5% or more of
    its unit's remaining gap ``bound − <element, S>`` (the bound by Cauchy–Schwarz,
    ``Σ ‖X_A‖ ‖X_B‖``; per head pair 1): a transformed copy's nested head classes close 60-90% of
    theirs every sweep and go on until exact; two unrelated models' rotations drift by a few
    parts in 10³ of a gap near the whole bound, without end, and stop (a 1.1B-shaped random pair:
    3 sweeps instead of 6). "exact": once no element changes (or none by more than ``tol``).
    "discrete": from the second sweep on, once no discrete element changes; it also stops a
    transformed copy's slow convergence early (fused QKV with grouped K/V: 8e-2 from exact
    instead of 2e-3). On the suite's trained pairs both keep every barrier within its
    pair-to-pair spread of "exact" (``benchmarks/results/speed_quality/sweep_rules.md``)."""
    groups: Callable | None = Field(None, json_schema_extra=_expects("a predicate group -> bool, or None"))
    """Optional predicate ``group -> bool`` selecting the classes to align. Unselected classes keep
    B's order; when a head class is unselected but classes fibred over it are selected, heads are
    paired by index and each head's inner element is solved."""
    rescale: StrictBool = Field(False, json_schema_extra=_expects("True or False"))
    """Zhang et al. 2024's rescaling, a positive scalar per head of each ``gl`` class after the
    rotations (``alignment.scales``)."""
    reg: Positive | None = Field(None, json_schema_extra=_expects("a positive entropic regularisation, or None "
                                                                   "(exact transport; 0.01 for sinkhorn)"))
    """The entropic regularisation of ``solver="sinkhorn"`` (default 0.01); None: exact transport."""
    masses: Masses = Field("auto", json_schema_extra=_expects("one of 'auto', 'weights', 'activations', 'uniform'"))
    """The units' masses in a transport between different widths: "auto" (what each unit
    contributes: activation RMS × outgoing weight norm with ``data``, weight norm without),
    "weights", "activations", "uniform" (see :mod:`~symgraph.alignment.masses`). Explicit
    "weights"/"activations" also apply to ``solver="ot"``/``"sinkhorn"`` between equal widths."""
    fold_norms: StrictBool = Field(True, json_schema_extra=_expects("true or false"))
    """Analyse with foldable norm gains folded (``symgraph.analyze``): residual streams are then
    solved as orthogonal maps (RMSNorm) or orthogonal maps fixing 𝟙 (LayerNorm); False keeps them
    permutations."""
    outputs: Outputs = Field(None, json_schema_extra=_expects(
        "a list of the outputs a symmetry must keep (names such as ['logits'], or positions), or None (all)"))
    """The model outputs the alignment must keep (``symgraph.analyze``'s ``outputs``: a list of
    names such as ``["logits"]`` for a model that also returns hidden states, or positions of a
    tuple output); default all."""
    refine: Steps = Field(0, json_schema_extra=_expects(f"a number of steps (an integer >= 0, at most {MAX_REFINE})"))
    """After solving, optimise the elements for this many steps so that the model interpolated at
    λ ~ U(0.4, 0.6) has low loss on ``data`` (learned matching; see
    :mod:`symgraph.alignment.refine`); needs ``data``."""
    loss_fn: Callable | None = Field(None, json_schema_extra=_expects(
        "a function loss_fn(model, batch) -> scalar tensor, or None (the model's own loss)"))
    """``loss_fn(model, batch)``: the loss ``refine`` lowers (default: the model's own, e.g.
    language-model loss)."""
    refine_lr: Positive = Field(1e-3, json_schema_extra=_expects("a positive step size"))
    """The Adam step size of ``refine``."""
    between: Callable | None = Field(None, json_schema_extra=_expects(
        "a function between(θ_A, θ_B′, λ) -> model, or None (the linear interpolation)"))
    """``between(θ_A, θ_B′, λ) -> model``: the model between A and B that learned matching trains
    (default: the linear interpolation in A's architecture;
    ``symgraph.merging.driver.circuit_between(model_a)`` trains in circuit space)."""
    full_groups: StrictBool = Field(False, json_schema_extra=_expects("true or false"))
    """After the orthogonal parts are solved, fit the rest of the groups the report claims (GL per
    head on QK and VO, the scales of RoPE's scaled rotations: :func:`~symgraph.alignment.rescale.fit_gl`),
    keeping a fit only where it brings B closer to A; exact for a transformed copy. False keeps
    the orthogonal elements."""
    similarity: Literal["exact", "bf16"] = Field("exact", json_schema_extra=_expects("'exact' or 'bf16'"))
    """The precision of the weight-matching products: "exact" (permutation classes in the weights'
    own dtype, bfloat16 for a bf16 checkpoint, float32 for a float16 one, whose range products overflow;
    rotations in float64, float32 for 16-bit weights) or
    "bf16" (every product in bfloat16, faster on a CPU with bf16 units; each product's result is
    rounded to bfloat16, so the solution can differ from the exact one; see docs/benchmarks.md)."""
    sketch: Columns = Field(0, json_schema_extra=_expects(
        f"0 (exact) to {MAX_COLUMNS} projection columns"))
    """k > 0: permutation classes compare their rows through a shared random projection of k
    columns where a matrix's other axis is wider than 2k (Johnson–Lindenstrauss;
    ``WeightFeatures``); 0 (default) computes the similarity exactly."""
    rows: dict[str, torch.Tensor] | None = Field(None, json_schema_extra=_expects(
        "a mapping of parameter names to 1-D integer index tensors (e.g. report.input_rows(batches))"))
    """``{parameter: row indices}``: weight matching reads only these rows of those parameters
    (e.g. ``report.input_rows(data)``: the token embeddings of tokens the data holds, as Theus et
    al. 2025 match; the other rows of a trained model are its random initialisation). Default:
    every row."""
    tol: Fraction = Field(0.0, json_schema_extra=_expects(
        "a relative gain in [0, 1) below which a re-solved class keeps its element (0: every change)"))
    """A class re-solved in a later sweep keeps its element unless the new one raises its own
    objective ``<element, S>`` by more than this fraction: near-ties and rotations that move in the
    fifth digit then stop re-solving every class that reads them, and the sweeps end. 0 (default)
    takes every change (sweeps until ``until`` ends them, at most ``max_iter``): the objective is flat
    near its optimum, so any tol also ends the slow convergence of nested classes (query heads
    within a fused GQA block)."""
    block_scale: Literal["none", "columns"] = Field("none", json_schema_extra=_expects("'none' or 'columns'"))
    """"none" (default: each slot's contribution as is) or "columns": a rotation class's slots (the
    residual stream's embeddings, head and block weights) each divided by their number of columns,
    as Theus et al. 2025 scale each block by 1/√columns on both sides, so that the embedding table
    does not outweigh every block weight."""
    head_cost: Literal["procrustes", "circuits"] = Field(
        "procrustes", json_schema_extra=_expects("'procrustes' or 'circuits'"))
    """How a head family's heads are paired by weights: "procrustes" (default: each pair scored by
    its best inner rotation, summed over the classes) or "circuits" (the ``gl`` classes score a
    pair by the distance of its circuits ``W_Qᵀ W_K`` and ``W_O W_V``, invariant under the whole
    GL(d_k) per head: Theus et al. 2025's head cost)."""
    defer: StrictBool = Field(True, json_schema_extra=_expects("True or False"))
    """True (default): a unit whose last re-solve kept its elements (an MLP permutation once the
    residual stream settles) waits while other units still change, and is re-solved against them
    once they converge (``Sweeps.run``); False re-solves every unit whose inputs changed in every
    sweep."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise InputError(_explain(e.errors()[0], data)) from None
        self._check_together()

    def _check_together(self) -> None:
        """Refuse an option that only another one's value makes use of (it would be ignored)."""
        if self.reg is not None and self.solver != "sinkhorn":
            raise InputError(f"reg={self.reg!r} is the entropic regularisation of solver='sinkhorn', and solver is "
                             f"{self.solver!r}; expected solver='sinkhorn' with reg (or no reg)")
        if not self.refine:
            used = [k for k in ("loss_fn", "between") if getattr(self, k) is not None]
            used += ["refine_lr"] if self.refine_lr != type(self).model_fields["refine_lr"].default else []
            if used:
                raise InputError(f"{used[0]}= is an option of learned matching, and refine is 0; expected refine=N "
                                 f"(N > 0 steps) with {used[0]} (or no {used[0]})")

    @field_validator("rows")
    @classmethod
    def _index_rows(cls, v):
        for name, idx in (v or {}).items():
            if idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool:
                raise ValueError(f"maps {name[:80]!r} to a {idx.dim()}-D {str(idx.dtype).removeprefix('torch.')} "
                                 "tensor")
        return v

    def selected(self, group) -> bool:
        """Whether ``groups`` selects ``group`` (every group without a predicate)."""
        return True if self.groups is None else bool(self.groups(group))

    @classmethod
    def build(cls, options: AlignOptions | None = None, **kw) -> AlignOptions:
        """``options`` (default: every field's default) with the fields in ``kw`` replaced;
        refuses a keyword that is no field, naming the fields."""
        names = set(cls.model_fields)
        bad = sorted(set(kw) - names)
        if bad:
            raise InputError(f"unknown align option(s) {bad}; expected some of {sorted(names)}")
        if options is not None and not isinstance(options, cls):
            raise InputError(f"options is a {type(options).__name__}; expected an AlignOptions (or its fields "
                             "as keywords)")
        if options is not None and not kw:
            return options
        base = options if options is not None else cls()
        return cls(**{k: kw.get(k, getattr(base, k)) for k in cls.model_fields})


def _explain(err, data: dict) -> str:
    """One line for pydantic's first error about the fields ``data`` gave."""
    key = error_key(err)
    if err.get("type") == "extra_forbidden":
        return f"unknown align option {key!r}; expected some of {sorted(AlignOptions.model_fields)}"
    v = data.get(key)
    return refusal(err, f"{key}={short_repr(v)} ({type(v).__name__})", expected(AlignOptions, key))

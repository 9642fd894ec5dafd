"""Helpers of the ``symgraph.analyze`` tests (``test_analyze*.py``): the tolerance, selecting
groups by parameter prefix, the MLP table of the tiny transformers, a coverage row's model built
as the coverage tool builds it, and the parameters example inputs leave unread."""
from __future__ import annotations

TOL = 1e-6


def names(group):
    return {p for p, _ in group.params}


def slots(group):
    return set(group.params)


def in_layer(groups, prefix):
    """Groups all of whose parameters live under ``prefix`` (e.g. ``"transformer.h.0."``)."""
    return [g for g in groups if all(p.startswith(prefix) for p in names(g))]


def one(groups, what):
    assert len(groups) == 1, f"expected exactly one {what}, got {[(g.kind, g.size, g.blocks) for g in groups]}"
    return groups[0]


def certified_mlp(model, up: str, down: str, size: int):
    """``model`` analysed with no inputs and certified, its MLP's hidden units one permutation
    class of ``size`` at ``up``'s output that ``down`` reads; returns the report."""
    import symgraph
    r = symgraph.analyze(model)
    assert r.certify(model) < TOL
    (mlp,) = r.group_of(up, 0)
    assert mlp.kind == "perm" and mlp.size == size
    assert (down, 1) in mlp.params
    return r


def rel_change(a, b):
    return ((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30)).item()


MLP = {  # layer prefix, MLP up-projection (param, out dim), MLP width attribute
    "bert": ("bert.encoder.layer.{i}.", ("intermediate.dense.weight", 0), "intermediate_size"),
    "gpt2": ("transformer.h.{i}.", ("mlp.c_fc.weight", 1), "n_inner"),
    "llama": ("model.layers.{i}.", ("mlp.up_proj.weight", 0), "intermediate_size"),
    "vit": ("vit.layers.{i}.", ("mlp.fc1.weight", 0), "intermediate_size"),
}


def coverage_row(model_type: str, class_name: str):
    """The model of a coverage table's row, built as ``benchmarks.coverage`` builds it (its
    shrunk config, random weights), without the library's warnings."""
    import warnings

    from benchmarks.coverage.shrink import build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(model_type, class_name)[0]


def unread(model, kwargs) -> set:
    """The parameters of ``model`` its forward on ``kwargs`` never reads (the forward must run)."""
    from symgraph.passes.optional_inputs import Trials
    read = Trials(model, {}).reads(kwargs)
    assert read is not None
    return {n for n, _ in model.named_parameters()} - read

"""Checkpoints stored as the Hub stores them, read and written out of core in that form.

transformers 5 keeps some models' tensors in another form than their checkpoints: the experts
of a mixture of experts as one stacked tensor (``experts.gate_up_proj``, ``[E, 2I, H]``) where
the checkpoint, and ``save_pretrained`` itself, store one matrix per expert
(``experts.0.gate_proj.weight``, ...); a fused or renamed tensor elsewhere. ``from_pretrained``
converts them on load with the library's own weight conversions
(:func:`transformers.conversion_mapping.get_model_conversion_mapping`) and ``save_pretrained``
converts back. :class:`Conversion` applies the same conversions one tensor group at a time:
the model's tensor ``experts.gate_up_proj`` is read as transformers builds it from the
checkpoint's per-expert matrices (:meth:`Conversion.read`), and a writer
(:class:`ConvertingWriter`) turns each merged group back into the checkpoint's tensors, so the
output is stored as the input was (names, shapes, dtypes, sharding).

A conversion is used only where it is exact from the headers alone: every checkpoint tensor
goes to a tensor of the model, every tensor of the model comes from the checkpoint with the
model's shape (each group converted once on the ``meta`` device, reading nothing), and the
conversion back gives exactly the checkpoint's tensors (names and shapes, each in a dtype that
holds the stored one exactly: experts stored in bfloat16 and float32 stack into float32, and
each goes back in its own). Anything else is not converted (the checkpoint is then refused, or loaded by ``from_pretrained``, as before).

A converted tensor is read whole (a row slice is cut from it) and, while it is built, its
sources are held beside it: reading ``experts.gate_up_proj`` holds twice its bytes for a moment.
The other tensors one source makes (``q``, ``k`` and ``v`` of a fused ``qkv``) are kept until
they are read or another group is; the writer holds a group until its last tensor comes.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from .layout import Layout

__all__ = ["Conversion", "ConvertingWriter", "conversion_error", "refuse_conversion"]


@dataclass
class _Group:
    """One conversion: ``transform`` (a transformers ``WeightTransform``, copied for each use)
    takes ``sources`` (``[(source pattern, tensor name)]``, in order) to ``targets``
    (``{name: (shape, dtype)}``); ``first`` names the group as transformers does."""
    transform: Any  # a transformers WeightTransform
    first: str
    sources: list
    targets: dict

    def run(self, fetch, model) -> dict:
        """``{target name: tensor}`` from the sources ``fetch(name)`` gives."""
        t = copy.deepcopy(self.transform)
        for pattern, name in self.sources:
            t.add_tensor(self.first, name, pattern, lambda name=name: fetch(name))
        out = t.convert(self.first, model=model, config=getattr(model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def _grouped(keys, transforms, state: dict, prefix: str | None, reverse: bool) -> dict | None:
    """``{first name: (transform, [(pattern, key)])}``: ``keys`` grouped as transformers'
    loader (``reverse=False``) or ``save_pretrained`` (``reverse=True``) groups them; None
    where a key names no tensor of ``state`` (loading)."""
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, apply_converters,
                                                 apply_renamings, dot_natural_key, rename_source_key)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict = {}
    for key in sorted(keys, key=dot_natural_key):
        if reverse:
            name, pattern = apply_converters(key, converters)
            name = name if pattern is not None else apply_renamings(key, renamings)
        else:
            name, pattern = rename_source_key(key, renamings, converters, prefix, state)
            if name not in state and key in state:
                name, pattern = rename_source_key(key, [], [], prefix, state)
            if name not in state:
                return None
        proto = by_pattern[pattern] if pattern is not None else WeightRenaming(key, name)
        groups.setdefault(name, (proto, []))[1].append((pattern if pattern is not None else key, key))
    return groups


def _loading_groups(model, source: Layout) -> tuple:
    """``(transforms, state, groups)``: transformers' conversion mapping of ``model``, its state
    and ``source``'s keys grouped as ``from_pretrained`` groups them (groups None where a key
    names no tensor, or where transformers defines no mapping for the model)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - not a transformers model, or a mapping it cannot build
        return [], {}, None
    state = dict(model.state_dict())
    return transforms, state, _grouped(source.keys, transforms, state, getattr(model, "base_model_prefix", None),
                                       False)


def _on_meta_fetch(shapes: dict, dtypes: dict):
    """``name -> meta tensor`` of the stored shape and dtype (nothing read)."""
    return lambda k: torch.empty(shapes[k], dtype=dtypes[k], device="meta")


def _on_meta(groups: dict, shapes: dict, dtypes: dict, model, renamings=()) -> list | None:
    """Each group of :func:`_grouped` run on ``meta`` tensors of ``shapes`` and ``dtypes`` (nothing
    read): its :class:`_Group`, or None where a conversion fails there."""
    from transformers.core_model_loading import WeightConverter, apply_renamings
    out = []
    for first, (proto, sources) in groups.items():
        g = _Group(proto, first, sources, {})
        try:
            made = g.run(_on_meta_fetch(shapes, dtypes), model)
        except Exception:  # noqa: BLE001 - an operation that needs values: not converted out of core
            return None
        if isinstance(proto, WeightConverter) and renamings:  # saving renames after converting
            made = {apply_renamings(k, renamings): v for k, v in made.items()}
        g.targets = {k: (tuple(v.shape), v.dtype) for k, v in made.items()}
        out.append(g)
    return out


def conversion_error(model, source: Layout, fetch) -> str | None:
    """Why transformers' own conversion of the checkpoint ``source`` into ``model``'s tensors
    fails, as ``from_pretrained`` would fail on it (its refusal points at a report that a
    silenced logger never prints): the first group that fails on ``meta`` tensors and again on
    its stored tensors (``fetch(name)``), named with its sources and the error; None where
    every group converts (a conversion that needs values fails on ``meta`` alone)."""
    transforms, state, grouped = _loading_groups(model, source)
    for first, (proto, sources) in (grouped or {}).items():
        g = _Group(proto, first, sources, {})
        try:
            g.run(_on_meta_fetch(source.shapes, source.dtypes), model)
            continue
        except Exception:  # noqa: BLE001 - tried again on the stored values below
            pass
        try:
            g.run(fetch, model)
        except Exception as e:  # noqa: BLE001 - transformers' conversion fails on these tensors
            return (f"{first} cannot be built from its {len(sources)} stored tensors ({_odd(sources, source)}): "
                    f"{str(e).splitlines()[0][:160] if str(e) else type(e).__name__}")
    return None


def _odd(sources, source: Layout) -> str:
    """What sets a group's stored tensors apart: the one of another shape than the rest, or
    how many each source pattern matched (an expert more for one matrix than another)."""
    names = [k for _, k in sources]
    shapes = Counter(tuple(source.shapes[k]) for k in names)
    if len(shapes) > 1:
        common = shapes.most_common(1)[0][0]
        odd = [k for k in names if tuple(source.shapes[k]) != common]
        more = f" (+{len(odd) - 1} more)" if len(odd) > 1 else ""
        return (f"{odd[0]!r}{more} is {list(source.shapes[odd[0]])} where the other {len(names) - len(odd)} "
                f"are {list(common)}")
    return ", ".join(f"{n} stored as {p!r}" for p, n in Counter(p for p, _ in sources).items())


def refuse_conversion(model, layout: Layout, where: str) -> None:
    """Refuse, in one line naming the tensors, a checkpoint whose tensors transformers' own
    conversions cannot build ``model``'s from (:func:`conversion_error`)."""
    why = conversion_error(model, layout, layout.read)
    if why:
        raise InputError(f"cannot load {where}: {why}; expected the tensors save_pretrained writes for "
                         "this config")


class Conversion:
    """How the checkpoint of ``layout`` becomes ``model``'s tensors (``model`` built on ``meta``)
    and back. :attr:`layout`: the checkpoint as the model names it (its keys the model's, each
    in the file of its group's first source); :meth:`read` a model tensor;
    :meth:`writer` the writer that stores merged tensors as the checkpoint did.
    :meth:`of` builds one, or gives None where the conversion is not exact."""

    def __init__(self, model, source: Layout, groups: list, transforms: list, layout: Layout):
        self.model, self.source, self.groups, self.layout = model, source, groups, layout
        self._transforms = transforms
        self.group_of = {k: g for g in groups for k in g.targets}
        self._held: dict = {}  # the other targets of the group read last (qkv read for q: k and v)

    @classmethod
    def of(cls, model, source: Layout) -> Conversion | None:
        """The conversion of ``source`` into ``model``'s tensors, or None where transformers
        defines none for it or it is not exact (see the module's docstring)."""
        transforms, state, grouped = _loading_groups(model, source)
        groups = _on_meta(grouped, source.shapes, source.dtypes, model) if grouped else None
        if not groups:
            return None
        made = {k: v for g in groups for k, v in g.targets.items()}
        if any(k not in state or tuple(state[k].shape) != shape for k, (shape, _) in made.items()):
            return None
        keys = [k for k in state if k in made]
        files = {k: source.files[g.sources[0][1]] for g in groups for k in g.targets}
        layout = Layout(files, {k: made[k][0] for k in keys}, {k: made[k][1] for k in keys}, keys, source.pins)
        conv = cls(model, source, groups, [t for t in transforms if t.was_used()], layout)
        back = conv._made(layout.keys, layout.shapes, layout.dtypes)
        if back is None or {k: s for k, s, _ in back} != {k: source.shapes[k] for k in source.keys} or any(
                torch.promote_types(source.dtypes[k], d) != d for k, _, d in back):
            return None  # not stored back as it came: loaded by from_pretrained, as before
        return conv

    def read(self, name: str, fetch) -> torch.Tensor:
        """The model's tensor ``name``, converted from the sources ``fetch(key)`` reads (its
        group's other targets are kept for their own read, until another group is read)."""
        if name in self._held:
            return self._held.pop(name)
        made = self.group_of[name].run(fetch, self.model)
        self._held = {k: v for k, v in made.items() if k != name}
        return made[name]

    def _reverse(self, keys) -> tuple:
        from transformers.core_model_loading import WeightRenaming
        back = [t.reverse_transform() for t in self._transforms[::-1]]
        renamings = [t for t in back if isinstance(t, WeightRenaming)]
        return _grouped(keys, back, {}, None, True), renamings

    def plan(self, keys, shapes: dict, dtypes: dict) -> list | None:
        """``[(checkpoint key, shape, dtype)]`` the model's tensors ``keys`` (of ``shapes`` and
        ``dtypes``) are stored as, in the input's order where it has the key, each in the dtype
        the input stored it in (experts stored in two dtypes are one tensor of the wider one in
        the model, and go back each in its own); None where that fails."""
        made = self._made(keys, shapes, dtypes)
        return None if made is None else [(k, s, self.source.dtypes.get(k, d)) for k, s, d in made]

    def _made(self, keys, shapes: dict, dtypes: dict) -> list | None:
        """:meth:`plan` with the dtypes the conversion back makes."""
        grouped, renamings = self._reverse(keys)
        groups = _on_meta(grouped, shapes, dtypes, self.model, renamings)
        if groups is None:
            return None
        made = {k: v for g in groups for k, v in g.targets.items()}
        order = {k: i for i, k in enumerate(self.source.keys)}
        return [(k, *made[k]) for k in sorted(made, key=lambda k: order.get(k, len(order)))]

    def writer(self, plan, make) -> ConvertingWriter:
        """A writer of the model's tensors of ``plan`` (``[(key, shape, dtype)]``) that stores
        them as the checkpoint did, through the writer ``make(checkpoint plan)`` builds."""
        return ConvertingWriter(self, list(plan), make)


class ConvertingWriter:
    """Takes the model's tensors (whole, or in consecutive row slices, as
    :class:`~symgraph.checkpoints.sharded.ShardWriter` does), holds each until its group is
    complete (one tensor for a mixture's experts; q, k and v for a fused projection), converts
    the group back (transformers' reverse conversion) and hands the checkpoint's tensors to the
    writer underneath."""

    def __init__(self, conversion: Conversion, plan: list, make):
        self.conversion = conversion
        self.shapes = {k: tuple(s) for k, s, _ in plan}
        self.dtypes = {k: d for k, _, d in plan}
        grouped, self._renamings = conversion._reverse(list(self.shapes))
        self.groups = {k: (first, proto, sources) for first, (proto, sources) in grouped.items()
                       for _, k in sources}
        real = conversion.plan(list(self.shapes), self.shapes, self.dtypes)
        if real is None:
            raise RuntimeError("the merged tensors cannot be stored as the checkpoint was")  # a bug: checked on load
        self.inner = make(real)
        self._stored = {k: d for k, _, d in real}
        self._rows: dict = {}
        self._done: dict = {}

    def add(self, key, t) -> None:
        shape = self.shapes[key]
        if t.shape == shape:
            self._done[key] = t
        else:  # consecutive rows of a tensor written in slices
            buf, at = self._rows.get(key) or (torch.empty(shape, dtype=t.dtype), 0)
            buf[at:at + t.shape[0]] = t
            self._rows[key] = (buf, at + t.shape[0])
            if at + t.shape[0] < shape[0]:
                return
            self._done[key] = self._rows.pop(key)[0]
        first, proto, sources = self.groups[key]
        if all(k in self._done for _, k in sources):
            group = _Group(proto, first, sources, {})
            made = group.run(self._done.pop, self.conversion.model)
            from transformers.core_model_loading import WeightConverter, apply_renamings
            for k, v in made.items():
                name = apply_renamings(k, self._renamings) if isinstance(proto, WeightConverter) else k
                self.inner.add(name, v.to(self._stored[name]).contiguous())

    def close(self) -> dict:
        if self._rows or self._done:
            left = sorted({*self._rows, *self._done})
            raise RuntimeError(f"converting writer: {left[0]} was not stored")  # a bug
        return self.inner.close()

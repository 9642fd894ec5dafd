"""Alignment: similarity (from weights or activations) → schedule of solve units → solvers →
an :class:`Alignment` keyed by group id.

- ``checks``      refusals before aligning (finiteness, structure, data batches)
- ``weights``     similarity of a class from the weights, per parameter slot, cached
- ``products``    the slot products of weight matching (views gathered, cross products in slices)
- ``sums``        the sums weight matching owns and their Cauchy–Schwarz bounds
- ``shared``      weight matching shared between processes (``torch.distributed``)
- ``activations`` similarity from activations at the observation points the rules mark
- ``graphrun``    exported graphs run op by op, each weight read when an op takes it: the one
  runner of activations, statistics, REPAIR and learned matching
- ``masses``      unit masses for transport between classes of different widths
- ``schedule``    solve units (head families, single classes) and the first sweep's order
- ``solve_unit``  one unit from its similarity matrices (nested matching for heads, any depth)
- ``sweeps``      the coordinate-descent loop over units
- ``pairs``       a joint start for two permutation classes on one axis (a grouped convolution's
  groups and the channels each holds)
- ``rescale``     Zhang et al. 2024's per-head scalars after the rotations; GL and unit-scale fits
- ``fullgroups``  fitting the full groups from loaded models or checkpoints read on demand
- ``learning``    learned matching's steps (start, λ, Adam, projection back), whatever computes the loss
- ``refine``      learned matching in memory: the interpolated model's loss
- ``result``      :class:`Alignment` (apply / state / to_json / save)
- ``saved``       an alignment as a safetensors file (:func:`load_alignment`)
- ``options``     :class:`AlignOptions`: every option of :func:`align`, typed and checked once
- ``driver``      :func:`align`
- ``compare``     :func:`~.compare.compare`: is B a copy of A, derived from it, or unrelated
"""
from __future__ import annotations

from .driver import align
from .options import AlignOptions
from .result import Alignment, load_alignment

__all__ = ["align", "AlignOptions", "Alignment", "load_alignment"]

"""Rules for ops that act on the trailing spatial axes of every channel alike: pooling,
reflection / replication padding, upsampling, sampling at given positions (``grid_sampler_2d``,
deformable attention: the batch axis is shared with the positions, whose coordinates are fixed).

Each leading axis (batch, channels) passes through: the op is applied to every channel's
spatial slice separately, so a map along the channels commutes with it when the per-slice
function allows: any linear map for linear ops (average pooling, padding, interpolation), a
positive scaled permutation for max pooling (``max(c·x) = c·max(x)`` for ``c > 0``, and no
rotation or sign flip commutes with a maximum). Spatial axes are fixed (windows and indices
name positions), and a leading class may not vary along them.
"""
from __future__ import annotations

import torch

from ..registry import Meet, NoFiber, Unify, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


# op name -> number of trailing spatial axes
_LINEAR = {
    **{f"avg_pool{k}d": k for k in (1, 2, 3)},
    **{f"adaptive_avg_pool{k}d": k for k in (1, 2, 3)},
    **{f"_adaptive_avg_pool{k}d": k for k in (2, 3)},
    **{f"reflection_pad{k}d": k for k in (1, 2, 3)},
    **{f"replication_pad{k}d": k for k in (1, 2, 3)},
    **{f"upsample_nearest{k}d": k for k in (1, 2, 3)},
    **{f"_upsample_nearest_exact{k}d": k for k in (1, 2, 3)},
    "upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_trilinear3d": 3,
    "upsample_bicubic2d": 2, "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2,
}
_MAX = {
    **{f"max_pool{k}d": k for k in (1, 2, 3)},
    **{f"max_pool{k}d_with_indices": k for k in (2, 3)},
    **{f"adaptive_max_pool{k}d": k for k in (1, 2, 3)},
}
_SPATIAL = {getattr(aten, n): k for n, k in {**_LINEAR, **_MAX}.items() if hasattr(aten, n)}
_MAXES = {getattr(aten, n) for n in _MAX if hasattr(aten, n)}


@register(list(_SPATIAL), observe=list(_MAXES))
def spatial(ctx):
    packet = ctx.node.target.overloadpacket
    k = _SPATIAL[packet]
    x = ctx.arg(0)
    xa, shape = ctx.axes(x), ctx.shape(x)
    outs = ctx.out if isinstance(ctx.out[0], list) else [ctx.out]  # (values, indices)
    lead, space = xa[: len(xa) - k], xa[len(xa) - k:]
    why = f"{ctx.where}: spatial axis of {packet.__name__}"
    cons = [Meet(a, "identity", why) for a in space] + [NoFiber(a, s) for a in lead for s in space]
    for out in outs:
        cons += [Unify(o, a) for o, a in zip(out, lead)]
        cons += [Meet(a, "identity", why) for a in out[len(lead):]]
    if packet in _MAXES:
        cons += [Meet(a, "scaled_perm", f"{ctx.where}: max pooling is positively homogeneous "
                                        "per channel, not linear")
                 for a, n in zip(lead, shape) if n > 1]
    return cons


@register([p for p in (getattr(aten, "grid_sampler_2d", None),) if p is not None])
def grid_sample(ctx):
    """``out[n, c] = K(grid[n]) · x[n, c]``: linear in each channel's slice with one kernel for
    every channel, so any map of the channels passes; ``n`` indexes the positions too."""
    x, grid = ctx.arg(0), ctx.arg(1)
    xa, ga, out = ctx.axes(x), ctx.axes(grid), ctx.out
    why = f"{ctx.where}: sampled positions of grid_sampler_2d"
    cons = [Unify(out[0], xa[0]), Unify(ga[0], xa[0]), Unify(out[1], xa[1])]
    cons += [Meet(a, "identity", why) for a in (*xa[2:], *ga[1:], *out[2:])]
    return cons + [NoFiber(xa[1], s) for s in xa[2:]]

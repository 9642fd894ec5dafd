"""REPAIR (Jordan et al., ICLR 2023): the math of the merge engine's REPAIR step
(:mod:`~symgraph.merging.repair_stream` runs it, op by op, on the merge as it is written).

Averaging networks, even aligned ones, shrinks the spread of their hidden units ("variance
collapse"). REPAIR measures every repaired channel ``c`` of the parents (in A's basis) and of
the merge on data, and gives the merged channel the interpolated ``μ*_c = Σ_i w_i μ_{i,c}``,
``σ*_c = Σ_i w_i σ_{i,c}`` by an affine change of the layer that produces it
(:func:`correction`; ``μ_c``, ``σ_c`` the merge's)::

    s = σ*_c / σ_c      W'[c] = s · W[c]      b'[c] = s · (b[c] − μ_c) + μ*_c

A layer without a bias is only rescaled, ``s = rms*_c / rms_c``. The channels are the graph's
(:func:`symgraph.passes.channels.find_sites`: outputs of a linear map or conv that reach a
nonlinearity with no normalisation first), never found from names.

Per-channel moments are float64 sums (:class:`Moments`) over every sample, all-reduced under
``torch.distributed``. BatchNorm layers (Ainsworth et al.'s reset) get the population mean and
unbiased variance of their input in the merge (:func:`batchnorm_statistics`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..core import distributed, finite
from ..errors import InputError
from ..passes.channels import Site, find_sites

__all__ = ["Site", "find_sites", "Moments", "correction", "layer_errors", "batchnorm_layers",
           "batchnorm_statistics", "RepairLayer", "BatchNormReset", "RepairReport"]


def batchnorm_layers(model) -> list:
    """Names of the BatchNorm modules of ``model`` with running statistics (registration order)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None]


# --- measuring -------------------------------------------------------------------------------


class Moments:
    """Per-channel float64 sums ``n``, ``s1 = Σx``, ``s2 = Σx²`` at ``key`` (named in refusals)
    of the tensors ``values`` whose channels lie along ``dim``, summed over the processes under
    ``torch.distributed``."""

    def __init__(self, key, values, dim: int):
        self.key = key
        acc: list = [0, 0, 0]  # the count, then float64 sums once a value is added
        for x in values:
            x = x.detach().movedim(dim, -1)
            x = x.reshape(-1, x.shape[-1]).double()
            acc = [acc[0] + x.shape[0], acc[1] + x.sum(0), acc[2] + (x * x).sum(0)]
        if distributed.is_active():
            total = distributed.all_reduce_dict({(key, j): x for j, x in enumerate(acc)
                                                 if j == 0 or isinstance(x, torch.Tensor)})
            acc = [total.get((key, j), x) for j, x in enumerate(acc)]
        self.n, self.s1, self.s2 = acc

    def stats(self) -> tuple:
        """``(mean, std, rms)`` per channel."""
        mean, sq = finite.require_finite("REPAIR", f"the channel statistics at {self.key!r} on the data",
                                         self.s1 / self.n, self.s2 / self.n)
        return mean, (sq - mean * mean).clamp_min(0).sqrt(), sq.sqrt()


def batchnorm_statistics(moments: Moments, module: str) -> tuple:
    """``(mean, unbiased variance, samples)`` per channel of BatchNorm module ``module``'s input,
    whose sums ``moments`` holds; refused with fewer than 2 values per channel."""
    n, s1, s2 = int(moments.n), moments.s1, moments.s2
    if n < 2:
        raise InputError(f"BatchNorm module {module!r} saw {n} value(s) per channel on the data; "
                         "expected at least 2")
    mean = s1 / n
    var = (s2 / n - mean * mean).clamp_min(0) * (n / (n - 1))
    finite.require_finite("REPAIR", f"the input statistics of BatchNorm module {module!r}", mean, var)
    return mean, var, n


# --- the correction --------------------------------------------------------------------------


def correction(site, stats, target) -> dict:
    """``{parameter: f(tensor) -> corrected}`` of ``site``'s weight (and bias): ``W[c] ← s·W[c]``,
    ``b[c] ← s·(b[c] − μ_c) + μ*_c`` (no bias: ``s`` from the rms), in float64, cast back."""
    (mean, std, rms), (t_mean, t_std, t_rms) = stats, target
    m, t = (std, t_std) if site.bias is not None else (rms, t_rms)
    # a channel the merge made constant (relative to the layer's targets) cannot be rescaled
    live = m > 1e-12 * float(t.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
    scale = torch.where(live, t / torch.where(live, m, torch.ones_like(m)), torch.ones_like(m))

    def weight(W):
        shape = [1] * W.dim()
        shape[site.out_dim] = -1
        return (W.double() * scale.to(W.device).reshape(shape)).to(W.dtype)

    def bias(b):
        new = scale * (b.double().to(scale.device) - mean) + t_mean
        return new.to(device=b.device, dtype=b.dtype)

    return {site.weight: weight} | ({site.bias: bias} if site.bias is not None else {})


def layer_errors(stats, target, statistic):
    """``(mean |m/t − 1|, mean |μ − μ*| / σ*)`` over the channels with a positive target, ``m``
    the std (``statistic="std"``) or the root mean square (``"rms"``)."""
    (mean, std, rms), (t_mean, t_std, t_rms) = stats, target
    m, t = (std, t_std) if statistic == "std" else (rms, t_rms)
    ok = t > 0
    if not ok.any():
        return 0.0, 0.0
    return ((m[ok] / t[ok]) - 1).abs().mean().item(), \
        ((mean[ok] - t_mean[ok]).abs() / t_std[ok].clamp_min(1e-30)).mean().item()


# --- the report ------------------------------------------------------------------------------


@dataclass
class RepairLayer:
    """One repaired layer, ``statistic`` ``"std"`` (a bias: mean and std matched) or ``"rms"``;
    ``before`` / ``after``: the channels' mean ``|σ_merged / σ_target − 1|`` (or of the rms),
    ``mean_before`` / ``mean_after``: of ``|μ_merged − μ_target| / σ_target``."""
    weight: str
    bias: str | None
    channels: int
    statistic: str
    before: float
    after: float
    mean_before: float
    mean_after: float


@dataclass
class BatchNormReset:
    """One reset BatchNorm module, measured on ``samples`` values per channel; ``std_ratio``:
    the channels' mean ``σ_data / σ_running`` before the reset (below 1: variance collapsed),
    ``mean_shift``: of ``|μ_data − μ_running| / σ_data``."""
    name: str
    channels: int
    samples: int
    std_ratio: float
    mean_shift: float


@dataclass
class RepairReport:
    """What REPAIR did: ``layers`` (:class:`RepairLayer`, graph order), ``sequential`` (each
    layer measured with every earlier one corrected: always), ``passes`` over the data,
    ``seconds``, ``batchnorm`` (:class:`BatchNormReset`, forward order)."""
    layers: list = field(default_factory=list)
    sequential: bool = True
    passes: int = 0
    seconds: float = 0.0
    batchnorm: list = field(default_factory=list)

    def to_dict(self):
        return asdict(self)  # the layers and BatchNorm modules as dicts too

    def summary(self) -> str:
        n, nb = len(self.layers), len(self.batchnorm)
        bn = f"BatchNorm statistics reset in {nb} layers" if nb else ""
        if not n:
            return f"REPAIR: {bn or 'no channel to repair'}" + (f" ({self.seconds:.1f} s)" if nb else "")
        b, a = (sum(getattr(x, k) for x in self.layers) / n for k in ("before", "after"))
        return (f"REPAIR: {n} layers, {sum(x.channels for x in self.layers)} channels; mean "
                f"|σ/σ*−1| {b:.3g} → {a:.3g}{'; ' + bn if bn else ''} ({self.seconds:.1f} s)")

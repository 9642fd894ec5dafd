"""Helpers of the REPAIR tests (``test_repair*.py``): one intra-op thread, per-channel moments."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    yield
    torch.set_num_threads(n)


def moments(x):
    mean = x.mean(0)
    return mean, (x * x).mean(0).sub(mean * mean).clamp_min(0).sqrt(), (x * x).mean(0).sqrt()


class ReadsStatistics(torch.nn.Module):
    """A BatchNorm layer whose running statistics the forward reads by hand (no batch-norm op)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return (self.lin(x) - self.bn.running_mean) / self.bn.running_var.sqrt()


# --- brute-force references: a loaded model measured by forward hooks ------------------------


def pre_activations(model, weights, data):
    """``{weight name: [samples, channels]}``: outputs of the modules owning ``weights`` (channels
    last: linear layers)."""
    out, hooks = {}, []
    for w in weights:
        mod = model.get_submodule(w.rsplit(".", 1)[0])
        hooks.append(mod.register_forward_hook(
            lambda m, i, o, w=w: out.setdefault(w, []).append(o.detach().double().reshape(-1, o.shape[-1]))))
    try:
        with torch.no_grad():
            for batch in data:
                model(**batch) if isinstance(batch, dict) else model(*batch)
    finally:
        for h in hooks:
            h.remove()
    return {w: torch.cat(v) for w, v in out.items()}


def targets(parents, weights, names, data):
    """The parents' interpolated ``(mean, std, rms)`` per channel at each of ``names``."""
    acts = [pre_activations(p, names, data) for p in parents]
    return {n: [sum(w * moments(a[n])[j] for w, a in zip(weights, acts)) for j in range(3)] for n in names}


def repair_reference(model, parents, weights, names, data):
    """REPAIR by brute force, in place: the linear layers ``names`` (weight names, forward order)
    one after another, each measured on the whole data with the earlier ones corrected, get the
    parents' interpolated mean and std (no bias: root mean square) by rescaling their weight rows
    and shifting their biases."""
    goal = targets(parents, weights, names, data)
    for name in names:
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        mean, std, rms = moments(pre_activations(model, [name], data)[name])
        t_mean, t_std, t_rms = goal[name]
        with torch.no_grad():
            scale = t_std / std if mod.bias is not None else t_rms / rms
            if mod.bias is not None:
                mod.bias.copy_(scale * (mod.bias.double() - mean) + t_mean)
            mod.weight.copy_(mod.weight.double() * scale[:, None])


def batchnorm_inputs(model, data):
    """``{BatchNorm module name: [channels, values]}``: their inputs on ``data``, eval mode."""
    out, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: out.setdefault(
                name, []).append(a[0].detach().double().transpose(0, 1).flatten(1))))
    try:
        with torch.no_grad():
            for batch in data:
                model.eval()(**batch) if isinstance(batch, dict) else model.eval()(*batch)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v, 1) for k, v in out.items()}


def population_gap(model, data) -> float:
    """The largest difference between a BatchNorm module's running mean (variance) and the
    population mean (unbiased variance) of its input in ``model`` on ``data``, relative to the
    largest of its running statistics: 0 once every BatchNorm is reset in the model itself."""
    acts, gap = batchnorm_inputs(model, data), 0.0
    for name, x in acts.items():
        bn = model.get_submodule(name)
        for have, want in ((bn.running_mean, x.mean(1)), (bn.running_var, x.var(1))):
            gap = max(gap, float((have.double() - want).abs().max() / have.double().abs().max()))
    return gap

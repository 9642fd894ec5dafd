"""Every model symgraph builds from a config alone is a skeleton on ``meta``
(:func:`symgraph.core.devices.meta_model`): the checkpoint loader, resizing's shape probes
(:mod:`symgraph.width.resize`), the circuit-space model (:mod:`symgraph.width.heads`) and the
circuit-space merge (:mod:`symgraph.merging.circuits`). A legacy constructor
(``nn.Parameter(torch.FloatTensor(n))``: XLNet's attention and mask embedding) ignores
``torch.device("meta")``; each path registers it on meta too, never a CPU parameter.

Asserted: the device of every parameter as the module registers it, in each path."""
from __future__ import annotations

import types

import pytest
import torch
import transformers

import symgraph
from symgraph.core import devices
from symgraph.merging.circuits import CircuitHeads
from symgraph.testing import models
from symgraph.width import heads, resize

XLNET = dict(vocab_size=64, d_model=16, n_layer=2, n_head=4, d_head=4, d_inner=24, dropout=0.0)
LLAMA = dict(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=48, positions=64)


class LegacyLlama(transformers.LlamaForCausalLM):
    """A LLaMA that also makes one parameter the legacy way, as XLNet does."""

    def __init__(self, config):
        super().__init__(config)
        self.legacy = torch.nn.Parameter(torch.FloatTensor(4))


@pytest.fixture
def registered(monkeypatch):
    """``[(module class, name, device type)]`` of every parameter registered while the test runs
    (what :func:`~symgraph.core.devices.parameters_on_meta` passes on, once it has moved it)."""
    seen: list = []
    register = torch.nn.Module.register_parameter

    def record(module, name, param):
        if param is not None:
            seen.append((type(module).__name__, name, param.device.type))
        register(module, name, param)
    monkeypatch.setattr(torch.nn.Module, "register_parameter", record)
    return seen


def _xlnet():
    return transformers.XLNetLMHeadModel(transformers.XLNetConfig(**XLNET))


def test_the_recorder_sees_a_legacy_parameter_on_the_cpu_under_the_meta_device(registered):
    """Why the helper is needed: ``torch.device("meta")`` alone leaves XLNet's legacy parameters
    on the CPU (the recorder would see nothing wrong if it could not fail)."""
    cfg = transformers.XLNetConfig(**XLNET)
    with torch.device("meta"):
        transformers.XLNetLMHeadModel(cfg)
    cpu = {(c, n) for c, n, d in registered if d == "cpu"}
    assert ("XLNetRelativeAttention", "q") in cpu and ("XLNetModel", "mask_emb") in cpu


def test_meta_model_registers_every_parameter_on_meta(registered):
    model = devices.meta_model(transformers.XLNetLMHeadModel, transformers.XLNetConfig(**XLNET))
    assert {d for _, _, d in registered} == {"meta"}
    assert all(p.is_meta for p in model.parameters())
    assert ("XLNetRelativeAttention", "q", "meta") in registered and ("XLNetModel", "mask_emb", "meta") in registered


def test_resize_probes_shapes_on_meta(registered):
    model = _xlnet()
    registered.clear()
    shapes = resize._meta_shapes(model, model.config)
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert registered and {d for _, _, d in registered} == {"meta"}


def test_the_circuit_space_model_is_built_on_meta(registered):
    model = _xlnet()
    registered.clear()
    new, finish = heads.wide_model(model, model.config, "cpu")
    assert registered and {d for _, _, d in registered} == {"meta"}
    assert {p.device.type for p in new.parameters()} == {"cpu"}  # then emptied onto the device asked


def test_the_circuit_space_merge_builds_its_model_on_meta(registered):
    plain = models.build("llama", seed=0, **LLAMA)
    A = LegacyLlama(plain.config)
    report = symgraph.analyze(plain)
    ckpt = types.SimpleNamespace(model=A)
    circuits = CircuitHeads(types.SimpleNamespace(anchor=0), [ckpt, ckpt], "average", lambda: report)
    registered.clear()
    _, cfg, new = circuits.built()
    assert cfg.head_dim == 2 * plain.config.head_dim and type(new) is LegacyLlama
    assert ("LegacyLlama", "legacy", "meta") in registered and {d for _, _, d in registered} == {"meta"}
    assert all(p.is_meta for p in new.parameters())

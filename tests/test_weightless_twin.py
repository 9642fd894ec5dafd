"""``weightless_twin``: one copy of a model without its weights, on ``meta`` (the trial runs of
other entry points) or as fake CPU tensors (the twin whose trace gives a meta trace its
constants): shapes, dtypes, parameter types and ties kept, nothing of the model's shared."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from symgraph.core.devices import weightless_twin


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((6,), 2.0, dtype=torch.float64), persistent=False)
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)


@pytest.mark.parametrize("device, fake", [("meta", False), ("cpu", True)])
def test_the_twin_keeps_shapes_dtypes_and_ties_and_holds_no_weight(device, fake):
    torch.manual_seed(0)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    twin = weightless_twin(model, device)
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    got = dict(twin.named_parameters(remove_duplicate=False)) | dict(twin.named_buffers(remove_duplicate=False))
    assert sorted(got) == sorted(own)
    for k, t in got.items():
        assert (t.shape, t.dtype, t.device.type) == (own[k].shape, own[k].dtype, device), k
        assert isinstance(t, FakeTensor) is fake, k
        assert t.requires_grad == own[k].requires_grad, k
        assert isinstance(t, torch.nn.Parameter) == isinstance(own[k], torch.nn.Parameter), k
        assert t is not own[k]
    assert twin.head.weight is twin.emb.weight  # still tied
    twin.norm = torch.nn.Identity()  # what a trial method may do to its twin
    assert isinstance(model.norm, torch.nn.BatchNorm1d)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in before.items())

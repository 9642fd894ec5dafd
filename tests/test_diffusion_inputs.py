"""Example inputs for diffusers models from their configs (symgraph.passes.diffusion_inputs):
``symgraph.analyze(model)`` with no ``inputs=`` for the UNet, DiT, SD3, Flux and VAE, and a
diffusers model whose config does not tell its input refused with one line."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import InputError

diffusers = pytest.importorskip("diffusers")
from symgraph.passes.inputs import default_inputs  # noqa: E402
from symgraph.testing.diffusion import build, fixed_params  # noqa: E402

SHAPES = {
    "unet": {"sample": (2, 3, 8, 8), "timestep": (2,), "encoder_hidden_states": (2, 5, 8)},
    "dit": {"hidden_states": (2, 4, 4, 4), "timestep": (2,), "class_labels": (2,)},
    "sd3": {"hidden_states": (2, 4, 4, 4), "timestep": (2,), "encoder_hidden_states": (2, 5, 12),
            "pooled_projections": (2, 6)},
    "flux": {"hidden_states": (2, 4, 8), "img_ids": (4, 3), "timestep": (2,), "encoder_hidden_states": (2, 5, 12),
             "txt_ids": (5, 3), "pooled_projections": (2, 6)},
    "vae": {"sample": (2, 3, 8, 8)},
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_inputs_from_the_config(name):
    m, _ = build(name)
    args, kwargs = default_inputs(m)
    assert args == () and {k: tuple(v.shape) for k, v in kwargs.items()} == SHAPES[name]
    assert all(v.dtype == torch.float64 for k, v in kwargs.items() if k != "class_labels")
    with torch.no_grad():
        m(**kwargs)  # the model runs on them
    if name == "flux":  # image positions on a 2 x 2 grid, text at the origin
        assert kwargs["img_ids"][:, 1:].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert kwargs["timestep"].max() < 1  # Flux scales its timesteps by 1000 itself
    if name == "dit":
        assert kwargs["class_labels"].tolist() == [0, 1]


@pytest.mark.parametrize("name,fixed", [("flux", 7), ("sd3", 1)])
def test_analyze_with_no_inputs(name, fixed):
    m, _ = build(name)
    r = symgraph.analyze(m)
    assert r.frozen == [] and len(fixed_params(m, r)) == fixed and r.certify(m) < 1e-9


def test_a_config_without_channels_is_refused():
    class NoChannels(diffusers.ModelMixin, diffusers.ConfigMixin):
        @diffusers.configuration_utils.register_to_config
        def __init__(self, width: int = 4):
            super().__init__()
            self.lin = torch.nn.Linear(width, width)

        def forward(self, hidden_states):
            return self.lin(hidden_states)

    with pytest.raises(InputError, match="main input .* pass inputs=") as e:
        symgraph.analyze(NoChannels())
    assert "\n" not in str(e.value)

"""Refusals name what was asked (issue 60, class 9): ``symgraph barrier`` on an image classifier
(a tiny ViT, whose data file holds ``pixel_values`` and no labels) is refused before any
alignment, saying the barrier needs a loss the model computes from the data given, never
"refine needs a loss" (no refine was asked); in memory, in circuit space and out of core."""
from __future__ import annotations

import pytest
import torch

from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("vitbarrier")
    (root / "work").mkdir()
    models.build("vit", seed=0).save_pretrained(root / "inputs" / "v0")
    models.build("vit", seed=1).save_pretrained(root / "inputs" / "v1")
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))},
               root / "inputs" / "pix.pt")
    return root


@pytest.mark.parametrize("extra", [[], ["--attention", "circuits"], ["--out-of-core"], ["--align", "weights"]],
                         ids=["in_memory", "circuits", "out_of_core", "weights_only"])
def test_barrier_on_a_classifier_names_the_barrier(ws, extra, capsys):
    before = digest(ws)
    w = ws / "inputs"
    r = main_in_process(ws, "barrier", w / "v0", w / "v1", "--data", w / "pix.pt", *extra, "--out",
                        ws / "work" / "o", capsys=capsys)
    refused(r, "barrier needs a loss", "ViTForImageClassification computes none from its inputs 'pixel_values'",
             "expected a model that computes its own loss from the data file")
    assert "refine" not in r.stderr and "aligning" not in r.stderr, r.stderr  # refused before any alignment
    assert digest(ws) == before

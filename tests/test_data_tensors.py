"""Data tensors that are not ordinary ones (issue 60, class 6): a ``.pt`` data file whose
``input_ids`` (or any other tensor) is on the meta device, nested (ragged), sparse (COO or CSR),
quantized, or whose ``pixel_values`` are not floating point, is refused in one line naming the
tensor, the file and what it is; exit 2, nothing written, inputs untouched. A plain tensor or a
Parameter holding one is read as it is."""
from __future__ import annotations

import warnings

import pytest
import torch

from symgraph.checkpoints.specs import check_dense, load_data
from symgraph.errors import InputError
from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


def _exotic() -> dict:
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([ids[0, :5], ids[1, :7]])
        jagged = torch.nested.nested_tensor([ids[0, :5], ids[1, :7]], layout=torch.jagged)
    return {"meta": ({"input_ids": torch.empty(8, 12, dtype=torch.long, device="meta")}, "a meta-device tensor"),
            "nested": ({"input_ids": nested}, "a nested (ragged) tensor"),
            "jagged": ({"input_ids": jagged}, "a nested (ragged) tensor"),
            "sparse": ({"input_ids": ids.to_sparse()}, "a sparse_coo tensor"),
            "csr": ({"input_ids": ids.to_sparse_csr()}, "a sparse_csr tensor"),
            "quantized": ({"input_ids": torch.quantize_per_tensor(ids.float(), 1.0, 0, torch.quint8)},
                          "a quantized tensor"),
            "meta_labels": ({"input_ids": ids, "labels": torch.empty(8, 12, device="meta")},
                            "'labels' in"),  # a tensor beside the ids is checked too
            "bare_meta": (torch.empty(8, 12, dtype=torch.long, device="meta"), "a meta-device tensor")}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("datatensors")
    inp = root / "inputs"
    (root / "work").mkdir()
    models.build("llama", seed=0, **L).save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    models.build("vit", seed=0).save_pretrained(inp / "vit0")
    models.build("vit", seed=1).save_pretrained(inp / "vit1")
    for name, (obj, _) in _exotic().items():
        torch.save(obj, inp / f"{name}.pt")
    torch.save({"pixel_values": torch.randint(0, 255, (8, 3, 8, 8), dtype=torch.uint8)}, inp / "bytes.pt")
    return root


@pytest.mark.parametrize("name", list(_exotic()))
def test_exotic_input_ids_refused(ws, name, capsys):
    before = digest(ws)
    w = ws / "inputs"
    r = main_in_process(ws, "merge", w / "a", w / "b", "--align", "activations", "--data", w / f"{name}.pt",
                        "--out", ws / "work" / "o", capsys=capsys)
    refused(r, f"{name}.pt", _exotic()[name][1], "expected a dense CPU tensor")
    assert digest(ws) == before


def test_byte_pixel_values_refused(ws, capsys):
    before = digest(ws)
    w = ws / "inputs"
    r = main_in_process(ws, "barrier", w / "vit0", w / "vit1", "--data", w / "bytes.pt", capsys=capsys)
    refused(r, "'pixel_values' in", "bytes.pt", "has dtype uint8", "expected floating-point pixel values")
    assert digest(ws) == before


def test_plain_tensors_and_parameters_read_as_they_are(tmp_path):
    ids = torch.randint(0, 64, (8, 12))
    for i, x in enumerate((ids, torch.nn.Parameter(ids, requires_grad=False))):
        torch.save({"input_ids": x}, tmp_path / f"{i}.pt")
        got = load_data(str(tmp_path / f"{i}.pt"))
        assert type(got[0]["input_ids"]) is torch.Tensor and torch.equal(torch.cat([b["input_ids"] for b in got]), ids)


def test_subclass_refused():
    class Logged(torch.Tensor):
        pass
    with pytest.raises(InputError, match=r"'x' is a Logged \(a tensor subclass\); expected a dense CPU tensor"):
        check_dense(torch.zeros(2, 3).as_subclass(Logged), "'x'")

"""Alignment elements moved between devices: :func:`symgraph.core.elements.elements_on`."""
import torch

from symgraph.core.elements import Map, Perm, elements_on


def test_elements_move_whole_and_keep_their_values():
    P, M, R = Perm([2, 0, 1]), Map(torch.eye(3) * 2, torch.eye(3) / 2), torch.randn(2, 4, 4)
    moved = elements_on({"p": P, "m": M, "r": R, "other": None}, "meta")
    assert isinstance(moved["p"], Perm) and moved["p"].index.device.type == "meta"
    assert isinstance(moved["m"], Map) and moved["m"].co.device.type == moved["m"].contra.device.type == "meta"
    assert moved["r"].device.type == "meta" and moved["r"].shape == R.shape and moved["other"] is None
    back = elements_on(elements_on({"p": P, "m": M, "r": R}, "cpu"), "cpu")
    assert back["p"].index.tolist() == [2, 0, 1] and back["p"].index.dtype == torch.long
    assert torch.equal(back["m"].co, M.co) and torch.equal(back["m"].contra, M.contra) and torch.equal(back["r"], R)

"""Rows of parameters that index a vocabulary: the embedding rows an input picks, and the output
rows that produce a model output's channels, restricted to the ids some data holds
(``align(..., rows=...)``: Theus et al. 2025 match the rows of the tokens seen in training only;
the other rows of a trained model are mostly its random initialisation)."""
from __future__ import annotations

import torch

from ..errors import InputError
from .nodes import output_nodes, packet

__all__ = ["input_rows", "output_rows"]

_aten = torch.ops.aten
SHAPE_ONLY = {_aten.view, _aten.reshape, _aten._unsafe_view, _aten.clone, _aten.contiguous, _aten.alias}


def input_rows(an, batches) -> dict:
    """``{parameter: row indices}`` for each parameter whose rows the graph picks with
    ``embedding`` by a user input (reshaped at most) and reads nowhere else (token embeddings,
    not a head tied to them, whose every row is trained): the ids the ``batches`` (dicts keyed
    by the model's input names) hold. Rows no batch picks are rows a model trained on such data
    never updated."""
    out: dict = {}
    for node in an.graph.nodes:
        if node.op != "call_function" or packet(node.target) is not _aten.embedding:
            continue
        w, ids = node.args[0], node.args[1]
        while getattr(ids, "op", None) == "call_function" and packet(ids.target) in SHAPE_ONLY:
            ids = ids.args[0]
        if (getattr(w, "name", None) not in an.param_of or len(w.users) != 1
                or getattr(ids, "name", None) not in an.user_inputs):
            continue
        vals = [b[ids.name].reshape(-1) for b in batches if isinstance(b, dict) and ids.name in b]
        if vals:
            name = an.param_of[w.name]
            rows = torch.cat([*vals, *([out[name]] if name in out else [])])
            out[name] = torch.unique(rows.to(torch.long))
    return out


def output_rows(an, ids) -> dict:
    """``{parameter: row indices}`` for each parameter whose rows are the channels of a model
    output's last axis: the weight of a ``linear`` whose result is an output (reshaped at most)
    and that the graph reads nowhere else (an untied language-model head; a head tied to the
    embedding is read twice and left whole, as :func:`input_rows` leaves it). The rows are
    ``ids`` (e.g. the tokens of the training data, which a causal LM's outputs predict); ids
    outside the parameter's rows are refused."""
    ids = torch.unique(torch.as_tensor(ids).reshape(-1).to(torch.long))
    out: dict = {}
    end = next(n for n in an.graph.nodes if n.op == "output")
    flat = [o for i, o in enumerate(output_nodes(end)) if o is not None and (an.keep is None or i in an.keep)]
    for node in flat:
        while node.op == "call_function" and packet(node.target) in SHAPE_ONLY:
            node = node.args[0]
        if node.op != "call_function" or packet(node.target) is not _aten.linear:
            continue
        w = node.args[1]
        if getattr(w, "name", None) not in an.param_of or len(w.users) != 1:
            continue
        name = an.param_of[w.name]
        n_rows = an.shape_of(w)[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_rows):
            raise InputError(f"ids must lie in [0, {n_rows}) to select rows of {name}; got {int(ids.min())}..{int(ids.max())}")
        out[name] = ids
    return out

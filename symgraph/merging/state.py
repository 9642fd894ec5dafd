"""A model's weights in the anchor's basis, in the accumulation dtype: what the merge
driver and the universe merge combine."""
from __future__ import annotations

from collections.abc import MutableMapping

import torch

__all__ = ["aligned_state", "acc", "Accumulating"]


def aligned_state(m, al, ra, lazy: bool = False):
    """Model ``m``'s parameters and moved buffers (``ra.buffers``) in the anchor's basis by
    ``al`` (None: its own basis), each in the accumulation dtype (:func:`acc`); tied
    weights once, under ``named_parameters``' name. ``lazy``: an :class:`Accumulating`
    mapping that keeps them in their own dtype (the anchor's own tensors, not copies) and
    converts each at its read."""
    conv = (lambda t: t) if lazy else acc  # noqa: E731
    if al is None:
        st = {k: conv(p.detach()) for k, p in m.named_parameters()}
        st |= {k: conv(m.get_buffer(k).detach()) for k in ra.buffers}
        return Accumulating(st) if lazy else st
    own = dict(m.named_parameters())  # tied weights once, under their first name
    moved, st = al.state(m), {}
    for k in list(moved):  # each converted as the moved value is dropped: one copy at a time
        v = moved.pop(k)
        if k in own or k in ra.buffers:
            st[k] = conv(v)
    for k, p in own.items():
        st.setdefault(k, conv(p.detach()))
    for k in ra.buffers:
        st.setdefault(k, conv(m.get_buffer(k).detach()))
    return Accumulating(st) if lazy else st


class Accumulating(MutableMapping):
    """``{name: tensor}`` held in the tensors' own dtype and read in the accumulation dtype
    (:func:`acc`, converted at each read). A merge of two bf16 models that holds both parents'
    states in float32 needs 8 bytes a parameter for them; this holds 2 (the anchor's are its
    own tensors): with the models and the float32 merge, about 10 bytes a parameter instead of
    16 (a 7B pair on a GPU: about 68 GB by that count, against 109.5 GB measured before)."""

    def __init__(self, raw: dict):
        self.raw = raw

    def __getitem__(self, k):
        return acc(self.raw[k])

    def __setitem__(self, k, v):
        self.raw[k] = v

    def __delitem__(self, k):
        del self.raw[k]

    def __iter__(self):
        return iter(self.raw)

    def __len__(self):
        return len(self.raw)


def acc(t):
    """A weight in the accumulation dtype: float32 (float64 stays float64), on its device."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) if t.is_floating_point() else t

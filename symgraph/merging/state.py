"""A model's weights in the anchor's basis, in the accumulation dtype: what the shared-universe
alignment (:mod:`.universe`) averages between its rounds."""
from __future__ import annotations

import torch

__all__ = ["aligned_state", "acc"]


def aligned_state(m, al, ra):
    """Model ``m``'s parameters and moved buffers (``ra.buffers``) in the anchor's basis by
    ``al`` (None: its own basis), each in the accumulation dtype (:func:`acc`); tied
    weights once, under ``named_parameters``' name."""
    if al is None:
        st = {k: acc(p.detach()) for k, p in m.named_parameters()}
        return st | {k: acc(m.get_buffer(k).detach()) for k in ra.buffers}
    own = dict(m.named_parameters())  # tied weights once, under their first name
    moved, st = al.state(m), {}
    for k in list(moved):  # each converted as the moved value is dropped: one copy at a time
        v = moved.pop(k)
        if k in own or k in ra.buffers:
            st[k] = acc(v)
    for k, p in own.items():
        st.setdefault(k, acc(p.detach()))
    for k in ra.buffers:
        st.setdefault(k, acc(m.get_buffer(k).detach()))
    return st


def acc(t):
    """A weight in the accumulation dtype: float32 (float64 stays float64), on its device."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) if t.is_floating_point() else t

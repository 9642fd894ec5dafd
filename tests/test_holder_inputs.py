"""Issue 65, optional arguments of a parameter's own holder (:mod:`symgraph.passes.holder_inputs`):
a module the forward calls without the optional tensor argument that makes it read a parameter.
The trace runs the holder again on the argument the trial runs found (a tensor it is called with,
else a mask), adding ``0 *`` its result: the program computes the plain forward on any batch (its
consumers see the model's values), and reads the parameter, which a class now holds. Each case
reads every parameter, certifies in float64 and is recovered by weights from a transformed copy;
a holder whose optional argument reads nothing new is left as it is."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.passes.holder_inputs import HOLDERS, Injection, holder_injections
from symgraph.passes.trace import flatten_outputs



class Fusion(nn.Module):
    """A fusion layer as DPT's: a residual input, when given, goes through its own layers."""

    def __init__(self, d=16):
        super().__init__()
        self.res = nn.Sequential(nn.ReLU(), nn.Linear(d, d))
        self.out = nn.Linear(d, d)

    def forward(self, x, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + self.res(residual)
        return self.out(x)


class Fused(nn.Module):
    """The first fusion layer is called with no residual: its ``res`` no input ever reaches."""

    def __init__(self):
        super().__init__()
        self.inp, self.f0, self.f1, self.head = nn.Linear(4, 16), Fusion(), Fusion(), nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.relu(self.f1(self.f0(h), h)))


class Embed(nn.Module):
    """Embeddings whose mask token is read only on masked positions (DINOv2's form)."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.mask_token = nn.Linear(6, d), nn.Parameter(torch.randn(d))

    def forward(self, x, bool_masked_pos: torch.Tensor | None = None):
        e = self.proj(x)
        if bool_masked_pos is not None:
            e = torch.where(bool_masked_pos.unsqueeze(-1), self.mask_token.to(e.dtype), e)
        return e


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mlp, self.head = Embed(), nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16)), \
            nn.Linear(16, 3)

    def forward(self, x):
        e = self.embed(x)
        return self.head(e + self.mlp(e))


def recovered(model, rep, inputs) -> float:
    """A copy moved by a random element of every group (its orthogonal part: permutations,
    rotations), aligned back by weight matching: the largest entry left changed."""
    moved = symgraph.transform(model, rep.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(model, moved, inputs, report_a=rep, outputs=rep.outputs)
    got, want, was = al.apply(moved).state_dict(), model.state_dict(), moved.state_dict()
    assert max((was[k] - want[k]).abs().max().item() for k in want) > 0.1
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _same_on_another_batch(rep, model, x) -> float:
    """The largest difference between the program and the model on a batch not traced."""
    with torch.no_grad():
        got = flatten_outputs(rep.exported_program.module()(x))
        want = flatten_outputs(model.eval()(x))
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def test_a_fusion_layer_called_without_its_residual_is_run_on_its_input():
    torch.manual_seed(0)
    m, x = Fused().eval(), torch.randn(5, 4)
    assert holder_injections(m, (x,), {}) == [Injection("f0", "residual", index=0)]
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None and rep.exported_program.graph_module.meta[HOLDERS] == [Injection("f0", "residual", 0)]
    (h,) = rep.group_of("inp.weight", 0)  # h: positive scalings pass the residuals' ReLU
    assert h.kind == "scaled_perm" and h.size == 16
    assert rep.group_of("f0.res.1.weight", 0) == [h] == rep.group_of("f0.res.1.weight", 1)  # added to h, reads h
    assert rep.certify(m, (x,)) <= 1e-6
    assert _same_on_another_batch(rep, m, torch.randn(5, 4)) == 0.0  # the plain forward, exactly
    assert recovered(m, rep, (x,)) < 1e-5


def test_a_mask_token_is_read_on_a_mask_of_its_positions():
    torch.manual_seed(0)
    m, x = Masked().eval(), torch.randn(2, 7, 6)
    (inj,) = holder_injections(m, (x,), {})
    assert (inj.path, inj.arg, inj.index, inj.shape) == ("embed", "bool_masked_pos", None, (2, 7))
    mask = inj.value([x])
    assert mask.dtype == torch.bool and mask.shape == (2, 7) and mask[:, 1::3].all() and int(mask.sum()) == 4
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None
    stream = rep.group_of("embed.mask_token", 0)
    assert [g.kind for g in stream] == ["gl"]  # the stream the mask token stands in (no norm: any map)
    assert stream[0].id == rep.group_of("embed.proj.weight", 0)[0].id
    assert rep.certify(m, (x,)) <= 1e-6
    assert _same_on_another_batch(rep, m, torch.randn(2, 7, 6)) == 0.0
    assert recovered(m, rep, (x,)) < 1e-5
    # the claim holds of the masked function too: a transformed copy masks to the same outputs
    B = symgraph.transform(m, rep.random_transform(seed=2))
    with torch.no_grad():
        a, b = (k.head(k.embed(x, mask)) for k in (m, B))
    assert float((a - b).abs().max()) < 1e-5


class Ignoring(nn.Module):
    """An optional tensor argument that reads nothing more, and a layer the forward never calls."""

    def __init__(self):
        super().__init__()
        self.lin, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale: torch.Tensor | None = None):
        return self.lin(x)

    def other(self):  # another method reads it (no static proof that it is dead), and takes no input
        return self.unused.weight.sum()


class Outer(nn.Module):
    """``inner`` (a holder) under a head: the model whose forward never passes the optional argument."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_an_optional_argument_that_reads_nothing_new_is_not_kept():
    m, x = Outer(Ignoring()).eval(), torch.randn(3, 4)
    assert holder_injections(m, (x,), {}) == []
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is not None and "inner.unused.weight" in rep.unread
    assert HOLDERS in rep.exported_program.graph_module.meta and rep.exported_program.graph_module.meta[HOLDERS] == []
    assert all(g.kind == "identity" for g in rep.groups)  # the unread layer fixes every class


class Blowing(nn.Module):
    """An optional argument that reads ``w`` but makes the result infinite (``0 * inf`` is no zero)."""

    def __init__(self):
        super().__init__()
        self.lin, self.w = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + self.w / (residual - residual)
        return self.lin(x)


def test_an_argument_that_makes_the_holder_infinite_is_not_kept():
    m, x = Outer(Blowing()).eval(), torch.randn(3, 4)
    assert holder_injections(m, (x,), {}) == []
    assert "inner.w" in symgraph.analyze(m, (x,)).unread


@pytest.mark.parametrize("build, shape", [(Fused, (5, 4)), (Masked, (2, 7, 6))])
def test_a_model_on_meta_is_traced_with_the_same_holders_and_classes(build, shape):
    torch.manual_seed(0)
    x, real = torch.randn(*shape), build().eval()
    with torch.device("meta"):
        m = build().eval()
    rep, on_meta = symgraph.analyze(real, (x,)), symgraph.analyze(m, (x,))
    assert on_meta.unread is None
    assert on_meta.exported_program.graph_module.meta[HOLDERS] == rep.exported_program.graph_module.meta[HOLDERS] != []
    assert [(g.kind, g.size, g.params) for g in on_meta.groups] == [(g.kind, g.size, g.params) for g in rep.groups]


@pytest.mark.parametrize("build, shape", [(Fused, (5, 4)), (Masked, (2, 7, 6))])
def test_alignment_by_activations_runs_the_plain_forward_on_the_users_batches(build, shape):
    """The statistics come from the program run on the data: its values are the model's, and a
    moved copy is aligned back from them."""
    torch.manual_seed(0)
    m, gen = build().eval(), torch.Generator().manual_seed(7)
    data = [(torch.randn(*shape, generator=gen),) for _ in range(3)]
    rep = symgraph.analyze(m, data[0])
    assert rep.exported_program.graph_module.meta[HOLDERS] != []
    moved = symgraph.transform(m, rep.random_transform(seed=3, orthogonal=True))
    al = symgraph.align(m, moved, data=data, report_a=rep)
    got, want = al.apply(moved).state_dict(), m.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5


class Connector(nn.Module):
    """Two paths as Granite-Docling's connector: the fine one, taken on ``fine=True``, keeps
    every token (twice the coarse path's, which merges pairs); the forward never takes it."""

    def __init__(self, d=16):
        super().__init__()
        self.coarse, self.fine, self.out = nn.Linear(2 * d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, fine: bool = False):
        h = self.fine(x) if fine else self.coarse(x.reshape(x.shape[0], x.shape[1] // 2, -1))
        return self.out(torch.relu(h))


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.conn, self.head = nn.Linear(4, 16), Connector(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.conn(self.inp(x)))


def test_a_switch_left_off_is_tried_on_and_its_longer_result_joins_in_part():
    torch.manual_seed(0)
    m, x = Routed().eval(), torch.randn(2, 6, 4)
    assert holder_injections(m, (x,), {}) == [Injection("conn", "fine", flag=True)]
    rep = symgraph.analyze(m, (x,))
    assert rep.unread is None
    (h,) = rep.group_of("conn.fine.weight", 0)  # the fine path's hidden units: a class of their own
    assert h.kind == "scaled_perm" and rep.group_of("conn.out.weight", 1) == [h]
    assert rep.group_of("conn.coarse.weight", 0) == [h]  # both paths feed the one ReLU and out
    assert rep.certify(m, (x,)) <= 1e-6
    assert _same_on_another_batch(rep, m, torch.randn(2, 6, 4)) == 0.0
    assert recovered(m, rep, (x,)) < 1e-5

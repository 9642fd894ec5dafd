"""Issue 65, a method whose only result is codes (:mod:`symgraph.passes.entry_points`): a
quantizer's ``argmin`` over distances to a codebook the forward never reads, as a speech codec
turns audio into the codes a language model takes. Its integer result joins the program as
floats and is kept fixed: the codebook is read, its width moves with the hidden units it is
compared with (a permutation keeps every distance), certified, and a moved copy gives the same
codes. Kept as floating results alone, the method returned none and was refused."""
from __future__ import annotations

import torch

import symgraph
from symgraph.passes.entry_points import EntryPoint, entry_points
from symgraph.passes.holder_inputs import HOLDERS


class WithCodes(torch.nn.Module):
    """An MLP; ``codes`` quantizes its hidden states against a codebook the forward never reads."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 10), torch.nn.Linear(10, 3)
        self.codebook = torch.nn.Parameter(torch.randn(5, 10))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))

    def codes(self, x):
        return ((torch.tanh(self.up(x))[:, None, :] - self.codebook[None]) ** 2).sum(-1).argmin(-1)


def test_a_method_whose_only_result_is_codes_is_kept():
    torch.manual_seed(0)
    m, x = WithCodes().eval(), torch.randn(2, 4)
    assert entry_points(m, (x,), {}, ["codebook"]) == [EntryPoint("", "codes", ("main",))]
    rep = symgraph.analyze(m, (x,))
    assert EntryPoint("", "codes", ("main",)) in rep.exported_program.graph_module.meta[HOLDERS]
    (hidden,) = rep.group_of("codebook", 1)  # the states the codes compare: moved with the codebook
    assert rep.group_of("up.weight", 0) == [hidden] and hidden.kind == "perm" and hidden.size == 10
    assert rep.certify(m, (x,)) <= 1e-6
    moved = symgraph.transform(m, rep.random_transform(seed=5))
    with torch.no_grad():
        assert torch.equal(moved.codes(x), m.codes(x))  # the same codes

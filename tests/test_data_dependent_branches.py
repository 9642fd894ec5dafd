"""Issue 65, the trace errors and timeouts of the new-tasks table. A forward that branches on a
value of its data (LED's ``if is_index_global_attn.flatten().any().item():``) cannot be traced
symbolically: it is traced with the example's branch taken (``passes.trace._export``), and every
value the program reads as a number is kept as an output, so no class the report claims can
change a branch; where a branch not taken reads parameters, every parameter stays fixed (what that
branch does with them is unknown), and so does every parameter where the traced program never
reads one (an audio tower that a text-only input never reaches: VibeVoice's tokenizers)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from symgraph.errors import TraceError
from symgraph.passes.trace import trace
from tiny_modules import MaskBranch


class GlobalBranch(MaskBranch):
    """An MLP whose output gets an extra term only when the mask marks some token (LED)."""


class ChannelBranch(nn.Module):
    """A branch on one hidden unit's value: permuting the units would change the branch."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x):
        h = torch.relu(self.up(x))
        if (h[..., 0].sum() > 0).item():
            return self.down(h)
        return 2 * self.down(h)


class DeadTower(nn.Module):
    """A text path and a tower no output reads (its input not given)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)
        self.tower = nn.Sequential(nn.Linear(6, 40), nn.GELU(), nn.Linear(40, 6))

    def forward(self, x, audio=None):
        h = self.down(torch.relu(self.up(x)))
        return h if audio is None else h + self.tower(audio)


class BranchAndTower(MaskBranch):
    """A data-dependent branch taken (the mask marks a token) beside a tower no branch reads:
    only an ``audio`` input reaches it (Qwen2.5-Omni's length check branches on the data while
    its ``audio_bos_eos_token`` is read by nothing, UDOP's decoder patch embedding by no call)."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Linear(6, 6)

    def forward(self, x, mask, audio=None):
        h = super().forward(x, mask)
        return h if audio is None else h + self.tower(audio)


def _slots(rep, kind=None):
    return {(p, d): g.kind for g in rep.groups if kind is None or g.kind == kind for p, d in g.params}


def _inputs(mask_any=True):
    torch.manual_seed(1)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = mask_any
    return {"x": torch.randn(2, 5, 6), "mask": mask}


def test_a_branch_not_taken_that_reads_parameters_leaves_nothing_claimed():
    """The branch not taken reads ``extra``, with activations the trace never saw: what it
    would need of the other classes is unknown, so every parameter stays as it is."""
    torch.manual_seed(0)
    A, inp = GlobalBranch().eval(), _inputs(False)
    rep = symgraph.analyze(A, inp)
    assert set(_slots(rep).values()) <= {"identity"}
    from symgraph.passes.driver import analyze_graph
    an = analyze_graph(trace(A, inp)[0])
    axis = an.node_axes[an.param_nodes["up.weight"]][0]
    reasons = " ".join(w for _, w in an.uf.reasons.get(an.uf.find(axis)[0], []) if w)
    assert "extra.weight (and 1 more) is not read on the example inputs, traced with data-dependent" in reasons


def test_a_data_dependent_branch_is_traced_as_taken_and_certified():
    torch.manual_seed(0)
    A, inp = GlobalBranch().eval(), _inputs(True)
    ep, _, _ = trace(A, inp)
    assert any(n.target is torch.ops.aten._assert_scalar.default for n in ep.graph.nodes)
    used = set(ep.graph_signature.inputs_to_parameters.values())
    users = {ep.graph_signature.inputs_to_parameters[n.name]: len(n.users) for n in ep.graph.nodes
             if n.op == "placeholder" and n.name in ep.graph_signature.inputs_to_parameters}
    assert "extra.weight" in used and users["extra.weight"] > 0  # the branch taken
    rep = symgraph.analyze(A, inp)
    perm = _slots(rep)
    # the MLP's hidden units: one permutation class holding up's rows and down's columns
    hidden = [g for g in rep.groups if ("up.weight", 0) in g.params]
    assert len(hidden) == 1 and hidden[0].kind in ("perm", "scaled_perm")
    assert ("down.weight", 1) in hidden[0].params and ("up.bias", 0) in hidden[0].params
    assert perm[("up.weight", 0)] in ("perm", "scaled_perm")
    assert rep.certify(A, inp) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    assert float((A.up.weight - B.up.weight).abs().max()) > 0.1  # really scrambled
    C = symgraph.align(A, B, inp).apply(B)
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-6, n


def test_a_unit_read_as_a_number_is_never_permuted():
    torch.manual_seed(0)
    A, x = ChannelBranch().eval(), torch.randn(4, 6)
    rep = symgraph.analyze(A, (x,))
    assert _slots(rep).get(("up.weight", 0), "identity") == "identity"  # the branch reads unit 0
    assert rep.certify(A, (x,)) <= 1e-6


def test_a_guard_on_meta_still_refused_with_the_reason():
    with torch.device("meta"):
        A = GlobalBranch()
    with pytest.raises(TraceError, match="data-dependent"):
        trace(A, _inputs())


def test_parameters_never_read_leave_nothing_claimed_with_the_reason():
    """The tower is read on inputs with ``audio``, with activations never traced: every
    parameter stays as it is (``tests/test_unread_parameters.py`` has the tower read)."""
    torch.manual_seed(0)
    A, x = DeadTower().eval(), torch.randn(3, 6)
    rep = symgraph.analyze(A, (x,))
    assert set(_slots(rep).values()) <= {"identity"}
    assert not any(g.kind == "gl" and g.size >= 40 for g in rep.groups)
    assert rep.unread == "tower.0.weight (and 3 more) is never read by the traced inputs: pass inputs that use it"
    assert rep.certify(A, (x,)) <= 1e-6
    from symgraph.passes.driver import analyze_graph
    ep, _, _ = trace(A, (x,))
    an = analyze_graph(ep)
    axis = an.node_axes[an.param_nodes["up.weight"]][0]
    reasons = " ".join(w for _, w in an.uf.reasons.get(an.uf.find(axis)[0], []) if w)
    assert "tower.0.weight (and 3 more) is never read" in reasons


def test_the_recovered_guard_prints_no_partial_graph(capsys):
    torch.manual_seed(0)
    trace(GlobalBranch().eval(), _inputs())
    assert "def forward" not in capsys.readouterr().err


def test_an_unread_parameter_beside_a_branch_taken_is_not_said_to_be_read_by_a_branch():
    """The branch taken reads ``extra``; ``tower`` is read by no branch: the reason says the
    trace branched on the data, never that a branch not taken reads the tower."""
    torch.manual_seed(0)
    A, inp = BranchAndTower().eval(), _inputs(True)
    rep = symgraph.analyze(A, inp)
    assert rep.exported_program.graph_module.meta["symgraph_branches_taken"] is True
    assert set(_slots(rep).values()) <= {"identity"}
    assert rep.unread == ("tower.weight (and 1 more) is not read on the example inputs, traced with "
                          "data-dependent branches: unknown")
    assert "branch the example inputs do not take" not in rep.unread
    assert rep.certify(A, inp) <= 1e-6


class Selected(nn.Module):
    """An MLP whose output keeps the rows a mask on the input selects: a size the data decides."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(-1)
        return self.down(torch.relu(self.up(x))[rows])


def test_a_size_the_data_decides_is_taken_from_the_run_or_refused_on_meta():
    torch.manual_seed(0)
    x = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0], [2, 1, 0, 0]]) + 0.1 * torch.randn(3, 4)
    A = Selected().eval()
    rep = symgraph.analyze(A, (x,))
    (hidden,) = rep.groups
    assert hidden.size == 8 and ("up.weight", 0) in hidden.params
    assert rep.certify(A, (x,)) <= 1e-12
    with pytest.raises(TraceError, match=r"^Selected: the size of nonzero .* depends on the data .*line \d+, in forward\), and a model on "
                                         r"the meta device holds no values to take it from; expected the model "
                                         r"with its weights"):
        symgraph.analyze(Selected().to("meta"), (x,))

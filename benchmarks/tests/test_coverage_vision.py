"""The vision coverage table's pure parts (issue 65, item 4), without timm or torchvision: the
choice of a family's smallest variant, the completeness check on hand-written models, and the
table's totals."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import symgraph
from benchmarks.coverage.vision import (TARGET, candidates, channel_slots, completeness, markdown,
                                        smallest, summarize)
from symgraph.passes.trace import trace


def test_candidates_keep_the_smallest_size_word_shortest_first():
    names = ["convnext_small", "convnext_atto_ols", "convnext_atto", "convnext_tiny", "convnext_base"]
    assert candidates(names) == ["convnext_atto", "convnext_atto_ols"]
    # no size word: every name, shortest first, at most MAX_CANDIDATES
    assert candidates(["resnet101", "resnet18", "resnet50"]) == ["resnet18", "resnet50", "resnet101"]
    assert len(candidates([f"net{i:03d}" for i in range(40)])) == 8


def test_smallest_counts_and_skips_what_cannot_be_built():
    sizes = {"a18": 11, "a34": 21, "a10": None}

    def count(name):
        if sizes[name] is None:
            raise RuntimeError("cannot build")
        return sizes[name]
    assert smallest(list(sizes), count) == ("a18", 11)
    try:
        smallest(["a10"], count)
    except RuntimeError as e:
        assert "no variant builds" in str(e) and "a10" in str(e)
    else:
        raise AssertionError("a family with no buildable variant must fail")


class DepthwiseBlock(nn.Module):
    """conv-BN-ReLU, a depthwise conv, a projection, a residual: the MobileNet op pattern."""

    def __init__(self, c=8, hidden=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(c)
        self.expand = nn.Conv2d(c, hidden, 1)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, c, 1)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        y = torch.relu(self.bn1(self.dw(torch.relu(self.expand(x)))))
        x = x + self.project(y)
        return self.head(x.mean((2, 3)))


def test_channel_slots_are_the_convolutions_before_a_nonlinearity_or_a_norm():
    torch.manual_seed(0)
    m = DepthwiseBlock().eval()
    x = torch.randn(1, 3, 8, 8)
    ep = trace(m, (x,))[0]
    slots = {s for _, s in channel_slots(ep)}
    # the projection reaches no nonlinearity or norm (a residual add, then a mean and the head),
    # the head is the output: neither is expected
    assert slots == {("stem.weight", 0), ("expand.weight", 0), ("dw.weight", 0)}
    report = symgraph.analyze(m, (x,))
    st = completeness(ep, report)
    assert st["channels"] == 3 and st["missing"] == [], st["missing"]
    assert report.certify(m, (x,)) < 1e-9


class ConvClassifier(nn.Module):
    """SqueezeNet's head: a convolution to the classes, a ReLU, a mean: logits, not channels."""

    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(3, 6, 3)
        self.classifier = nn.Conv2d(6, 4, 1)

    def forward(self, x):
        return torch.relu(self.classifier(torch.relu(self.body(x)))).mean((2, 3))


def test_a_convolution_to_the_outputs_is_no_hidden_channel():
    ep = trace(ConvClassifier().eval(), (torch.randn(1, 3, 6, 6),))[0]
    assert [s for _, s in channel_slots(ep)] == [("body.weight", 0)]


class Fixed(nn.Module):
    """A channel multiplied by a constant varying along it: no permutation survives."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        scale = torch.arange(1.0, 5.0, device=x.device).view(1, 4, 1, 1)  # made in the graph
        return self.out(torch.relu(self.conv(x) * scale).sum((2, 3)))


def test_a_frozen_channel_is_missing_with_its_reason():
    m = Fixed().eval()
    x = torch.randn(1, 3, 4, 4)
    ep = trace(m, (x,))[0]
    st = completeness(ep, symgraph.analyze(m, (x,)))
    miss = [e for e in st["missing"] if e["kind"] == "channels"]
    assert [e["slots"] for e in miss] == [[["conv.weight", 0]]]
    assert miss[0]["why"]



class SharedMlp(nn.Module):
    """One conv-relu-conv MLP run on two scales under two names (CoaT's parallel blocks:
    ``mlp2 = mlp3``)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.mlp2 = self.mlp3 = nn.Sequential(nn.Conv2d(4, 6, 1), nn.ReLU(), nn.Conv2d(6, 4, 1))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.out((self.mlp2(h) + self.mlp3(h[..., ::2, ::2]).repeat_interleave(2, -1)
                         .repeat_interleave(2, -2)).mean((2, 3)))


def test_a_module_shared_under_two_names_is_complete_under_either():
    """The report names a shared tensor once; the graph may read it under the other name, which
    the check resolves through ``symgraph.tied_parameters`` (without them it finds a miss)."""
    m = SharedMlp().eval()
    x = torch.randn(1, 3, 4, 4)
    ep, report = trace(m, (x,))[0], symgraph.analyze(m, (x,))
    tied = symgraph.tied_parameters(m)
    assert any({"mlp2.0.weight", "mlp3.0.weight"} <= set(g) for g in tied)
    assert completeness(ep, report, tied)["missing"] == []
    assert completeness(ep, report)["missing"] != []

def _row(zoo, fam, stage, sound=None, complete=None):
    traced = stage == "done"
    if stage == "not_run":
        return {"model_type": fam, "class": None, "task": zoo, "stage": stage, "traced": False,
                "sound": None, "complete": None, "certificate": None, "error": None}
    return {"model_type": fam, "class": fam + "_t", "task": zoo, "stage": stage, "traced": traced,
            "sound": sound, "complete": complete, "certificate": 1e-15 if traced else None,
            "error": None if traced else {"stage": stage, "type": "E", "message": "m"},
            "structure": {"missing": [] if complete else
                          [{"kind": "channels", "module": "m", "why": "fixed: op"}]} if traced else None}


def test_summary_counts_what_the_zoo_runs_and_the_target():
    rows = [_row("timm", f"f{i}", "done", True, True) for i in range(9)]
    rows += [_row("timm", "bad", "done", True, False), _row("timm", "nobuild", "build"),
             _row("timm", "norun", "eager"), _row("timm", "notrace", "trace"),
             _row("torchvision", "resnet", "done", True, True), _row("timm", "late", "not_run")]
    s = summarize(rows)
    t = s["by_zoo"]["timm"]
    assert (t["tried"], t["cannot_build"], t["cannot_run"], t["runs"]) == (13, 1, 1, 11)
    assert t["sound_and_complete"] == 9 and t["meets_target"] == (9 / 11 >= TARGET) is False
    assert s["by_zoo"]["torchvision"]["meets_target"] is True
    assert s["blocked_by"] == {"channels": {"fixed: op": ["timm/bad"]}}
    assert s["not_run"] == ["timm/late"]  # never started: in no count
    res = {"header": {"command": "python -m benchmarks.coverage.vision", "git": {"commit": "abc"},
                      "versions": {"torch": "x"}, "jobs": 2, "timeout_s": 120.0, "mem_gb": 6.0,
                      "wall_seconds": 1.0}, "summary": s, "rows": rows}
    md = markdown(res)
    assert "| timm | 13 | 1 | 1 | 11 | 10 | 10 | 9 | 9 = 81.8 % (NOT met) |" in md
    assert "`channels` (1): fixed: op: timm/bad" in md
    assert "- not run (1: the run's time budget was spent first" in md


def test_redraw_leaves_nothing_constant_that_hides_a_slot():
    from benchmarks.coverage.vision import redraw
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 3))
    nn.init.zeros_(m[3].weight)
    redraw(m.eval())
    bn = m[1]
    for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var, m[3].weight, m[3].bias):
        assert float(t.std()) > 0.01
    assert float(bn.running_var.min()) >= 0.5 and float(bn.running_var.max()) <= 1.5
    assert float(bn.running_mean.abs().max()) <= 0.5


def test_a_feature_extractor_is_built_with_a_head_and_counted_without(monkeypatch):
    """timm's ``num_classes=0`` variants return their stream: built with a head for the
    analysis, counted without it when the smallest variant is chosen (a fake ``timm``)."""
    import types

    from benchmarks.coverage.vision import HEAD_CLASSES, build, meta_count

    class Net(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.num_classes, self.body = num_classes, nn.Linear(4, 4)
            self.head = nn.Linear(4, num_classes) if num_classes else nn.Identity()

    calls = []
    def create_model(name, pretrained=False, num_classes=None, **kw):
        calls.append((name, num_classes))
        return Net({"extractor": 0, "classifier": 7}[name] if num_classes is None else num_classes)
    monkeypatch.setitem(__import__("sys").modules, "timm", types.SimpleNamespace(create_model=create_model))
    assert build("timm", "extractor").head.out_features == HEAD_CLASSES
    assert build("timm", "classifier").head.out_features == 7  # its own head kept
    assert calls == [("extractor", None), ("extractor", HEAD_CLASSES), ("classifier", None)]
    assert meta_count("timm")("extractor") == 20  # the body alone: the head is not counted


def test_build_draws_the_same_model_whatever_ran_before(monkeypatch):
    """A row's weights come from its own seed, not from the global generator's state (issue 69:
    halonet_h1's certificate moved with the draw), and the global generator is left as it was."""
    import types

    import torch

    from benchmarks.coverage.vision import build

    def create_model(name, pretrained=False, **kw):
        return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(4, 3))
    monkeypatch.setitem(__import__("sys").modules, "timm", types.SimpleNamespace(create_model=create_model))
    torch.manual_seed(1)
    a = build("timm", "net")
    torch.rand(5)
    state = torch.get_rng_state()
    b = build("timm", "net")
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    c = build("timm", "net", seed=1)
    assert not torch.equal(a[0].weight, c[0].weight)


class _AuxNet(nn.Module):
    """A classifier whose auxiliary head runs only in training and pools ``aux`` pixels square
    (Inception's needs its designed size); ``aux=None``: training always fails."""

    def __init__(self, aux):
        super().__init__()
        self.aux, self.body, self.head, self.side = aux, nn.Conv2d(3, 4, 1), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        h = self.body(x)
        out = self.head(h.mean((2, 3)))
        if self.training:
            if self.aux is None:
                raise RuntimeError("no training here")
            return out, self.side(nn.functional.avg_pool2d(h, self.aux).mean((2, 3)))
        return out


@pytest.mark.parametrize("aux,size", [(80, 96), (None, 64), (40, 64)])
def test_the_image_size_lets_a_training_only_head_run(monkeypatch, aux, size):
    """The first image size at which a copy in training mode runs as well, so that the training
    run reads the auxiliary head; the first size that runs at all where training never does.
    The model's own state is untouched by the training check."""
    import types

    from benchmarks.coverage.vision import runnable
    made = []
    def create_model(name, pretrained=False, **kw):
        made.append(_AuxNet(aux))
        return made[-1]
    monkeypatch.setitem(__import__("sys").modules, "timm", types.SimpleNamespace(create_model=create_model))
    model, x, how = runnable("timm", "aux")
    assert how["input"] == [3, size, size] and tuple(x.shape) == (1, 3, size, size)
    assert not model.training

"""``compare`` never says ``derived`` without the evidence its rule needs (issue 60, class 8):
with ``--null 0`` no shuffled copy gives a null level or a p-value, so two independently
initialised models (whose median correlation after alignment, ~0.29, clears the excess a null
level of 0 would need) are ``undetermined``, never ``derived``; a copy is still ``same`` (that
needs no null); with a null drawn the same pair is ``unrelated``."""
from __future__ import annotations

import json

import pytest

import symgraph
from symgraph.testing import models

from cli_helpers import digest, main_in_process

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("nullzero")
    (root / "work").mkdir()
    a = models.build("llama", seed=0, **L)
    a.save_pretrained(root / "inputs" / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "inputs" / "b")
    symgraph.transform(a, symgraph.analyze(a).random_transform(seed=3)).save_pretrained(root / "inputs" / "moved")
    return root


def test_null_zero_is_undetermined_not_derived(ws, capsys):
    w = ws / "inputs"
    before = digest(w)
    r = main_in_process(ws, "compare", w / "a", w / "b", "--null", "0", "--out", ws / "work" / "cmp", capsys=capsys)
    assert r.returncode == 0, r.stderr
    rec = json.loads((ws / "work" / "cmp" / "compare.json").read_text())
    assert rec["verdict"] == "undetermined" and rec["p_value"] is None and rec["null"] == []
    assert rec["excess"] >= rec["threshold"]  # the old rule (null level taken as 0) said "derived" here
    assert rec["carriers"] == []
    assert digest(w) == before  # inputs untouched
    assert sorted(p.name for p in (ws / "work").iterdir()) == ["cmp"]  # nothing beside --out


def test_same_needs_no_null_and_a_drawn_null_decides():
    a = models.build("llama", seed=0, **L)
    moved = symgraph.transform(a, symgraph.analyze(a).random_transform(seed=3))
    assert symgraph.compare(a, moved, null=0).verdict == "same"
    res = symgraph.compare(a, models.build("llama", seed=1, **L), null=2)
    assert res.verdict == "unrelated" and res.p_value is not None
    assert "undetermined" in symgraph.compare(a, models.build("llama", seed=1, **L), null=0).summary()

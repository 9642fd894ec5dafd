"""``symgraph analyze MODEL --certify``: the README's first command certifies what it reports."""
from __future__ import annotations

import pytest

import re

from conftest import cli


@pytest.mark.slow
def test_analyze_certify_prints_a_small_deviation():
    r = cli("analyze", "tiny-llama", "--certify")
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"certified: random elements of all (\d+) groups change the outputs by at most (\S+)", r.stdout)
    assert m and int(m.group(1)) > 5 and float(m.group(2)) < 1e-6, r.stdout[-500:]


def test_summary_explains_its_columns_and_does_not_cut_module_names():
    import symgraph
    from symgraph.testing import models
    text = symgraph.analyze(models.build("bert")).summary()
    assert "blocks: independent copies" in text and "outer: the ids" in text
    assert "bert.encoder.layer.0.attention.self " in text  # 35 characters, whole

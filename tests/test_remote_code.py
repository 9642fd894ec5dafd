"""No code from a model directory ever runs."""
from __future__ import annotations

import pytest

import json
import subprocess
import sys

from symgraph.testing import models

from cli_helpers import ENV


@pytest.mark.slow
def test_model_directory_code_never_runs(tmp_path):
    """A config that asks for the directory's own code (``auto_map``) is refused in one line
    before transformers reads it: the code does not run, nothing prompts (stdin closed)."""
    d = tmp_path / "custom"
    models.build("llama", vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=32,
                 positions=32).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="evil", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (d / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "ran"
    (d / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    for args in (["analyze", d], ["merge", d, d, "--out", tmp_path / "o"]):
        r = subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True,
                           text=True, env=ENV, timeout=300, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, r.stderr
        assert "auto_map" in r.stderr and "configuration_evil.EvilConfig" in r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""
        assert not marker.exists() and not (tmp_path / "o").exists()

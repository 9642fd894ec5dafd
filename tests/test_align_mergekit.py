"""Align once, merge anywhere (must-show of the ecosystem issue): mergekit's own linear merge
(in its own venv, as the scale benchmark installs it) of A and ``symgraph align``'s output equals
``symgraph merge A B --align weights`` to one bf16 ulp, on a 2-layer LLaMA-shaped bf16 pair."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers as tf

from symgraph.cli.main import main

from conftest import checkpoint_tensors

pytestmark = pytest.mark.slow


def test_mergekit_linear_of_the_aligned_checkpoint_is_symgraphs_merge(tmp_path):
    from benchmarks.scale.common import SHAPES, ensure_mergekit, mergekit_config
    cache = Path(os.environ.get("SYMGRAPH_CACHE", Path.home() / ".cache" / "symgraph"))
    exe, msg = ensure_mergekit(cache / "mergekit-venv")
    assert exe is not None, msg  # installing mergekit needs the package index: a failure, not a skip
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPES["tiny"])).to(torch.bfloat16)
        m.save_pretrained(tmp_path / name)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["align", str(a), str(b), "--out", str(tmp_path / "b_in_a")]) == 0
    assert main(["merge", str(a), str(b), "--align", "weights", "--out", str(tmp_path / "sym")]) == 0
    cfg = tmp_path / "mk.yml"
    cfg.write_text(mergekit_config(a, tmp_path / "b_in_a"))
    r = subprocess.run([str(exe), str(cfg), str(tmp_path / "mk"), "--no-copy-tokenizer", "--no-cuda", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    # mergekit averages A and the bf16-rounded aligned B; symgraph averages A and the aligned B
    # before rounding. The two differ by the rounding of B' (half an ulp of |B'|, halved) plus
    # the output's: within one ulp of the larger input element, where a ≈ -b' cancels too.
    sym, mk = checkpoint_tensors(tmp_path / "sym"), checkpoint_tensors(tmp_path / "mk")
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(tmp_path / "b_in_a")
    assert set(sym) == set(mk) == set(ta)
    same = total = 0
    for k in sorted(sym):
        x, y = sym[k].float(), mk[k].float()
        assert sym[k].dtype == mk[k].dtype == torch.bfloat16, k
        scale = torch.stack([x.abs(), y.abs(), ta[k].float().abs(), tb[k].float().abs()]).amax(0)
        assert bool(((x - y).abs() <= 2.0 ** -7 * scale).all()), k  # one bf16 ulp
        exact = (0.5 * ta[k].float() + 0.5 * tb[k].float()).to(torch.bfloat16)
        assert torch.equal(mk[k], exact), k  # mergekit averaged what align wrote
        same += int((sym[k] == mk[k]).sum())
        total += x.numel()
    assert same > 0.5 * total  # most elements bit for bit
    # and the alignment did something: the aligned B is not B
    from safetensors.torch import load_file
    wb = load_file(str(b / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    wal = load_file(str(tmp_path / "b_in_a" / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(wb, wal)

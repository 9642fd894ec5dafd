"""Tampered alignment files given to ``symgraph apply``. A real alignment
of two tiny LLaMAs (``symgraph align``) is rewritten with one thing wrong in it: an index vector
with a repeated, out-of-range or missing entry or of a float dtype, a residual map that is not
orthogonal (saved as orthogonal, or as a plain matrix), a map of the wrong shape, NaN in a map,
a singular GL element, metadata missing, not JSON, of another format, without a key or altered,
an element of a group model B does not have, an element the metadata lists but the file lacks.
Each ends in exit 2 and one refusal naming the file, the group and what was expected; nothing
outside ``--out`` changes. Untampered files (including GL elements from ``full_groups``) still
apply and give B's function."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import symgraph
from symgraph.testing import models

from cli_helpers import ENV, digest, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)
ALIGNMENT = "symgraph_alignment.safetensors"


def run(ws, *args):
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ws / "work", timeout=300)


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["symgraph"])


def _write(path, tensors, meta):
    """``meta``: a dict (written as the JSON record), a str (written as is) or None (no metadata)."""
    md = None if meta is None else {"symgraph": meta if isinstance(meta, str) else json.dumps(meta)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=md)


def _logits(directory, ids):
    import transformers as tf
    m = tf.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return m(ids).logits.double()


def _rel(x, y) -> float:
    return float((x - y).norm() / y.norm())


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Models a, b (the pair aligned by ``symgraph align``) and bt (a random full-group transform
    of a, aligned back by ``symgraph.align(full_groups=True)``: GL elements, scaled rotations)."""
    root = tmp_path_factory.mktemp("ws4")
    inp, work = root / "inputs", root / "work"
    work.mkdir()
    (root / "notes.txt").write_text("the user's own file")
    A = models.build("llama", seed=0, **L).eval()
    A.save_pretrained(inp / "a")
    models.build("llama", seed=1, **L).save_pretrained(inp / "b")
    align = subprocess.Popen([sys.executable, "-m", "symgraph", "align", inp / "a", inp / "b", "--out",
                              inp / "aligned"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=work)
    rep = symgraph.analyze(A)
    Bt = symgraph.transform(A, rep.random_transform(seed=0))
    Bt.save_pretrained(inp / "bt")
    symgraph.align(A, Bt, report_a=rep, full_groups=True).save(str(inp / "gl.safetensors"))
    _, err = align.communicate(timeout=300)
    assert align.returncode == 0, err[-2000:]
    return root


# the CLI's alignment of a and b: group 0 the residual stream (orthogonal, saved as orthogonal,
# 32x32), 4 layer 0's value/output heads (gl, 2 blocks of 8x8), 5 layer 0's MLP units (perm, 48)
def _idx(f):
    def tamper(t, m):
        t["element.5.index"] = f(t["element.5.index"].clone())
        return t, m
    return tamper


def _repeat(i):
    i[1] = i[0]
    return i


def _out_of_range(i):
    i[0] = 48
    return i


def _set(key, f, kind=None, gid=None):
    def tamper(t, m):
        t[key] = f(t[key].clone())
        if kind:
            m["kinds"][gid] = kind
        return t, m
    return tamper


def _nan(E):
    E[0, 1, 1] = float("nan")
    return E


def _singular(E):
    E[0, 1] = E[0, 0]  # two equal rows in head 0's map
    return E


def _meta(f):
    def tamper(t, m):
        return t, f(m)
    return tamper


def _drop(key):
    def f(m):
        del m[key]
        return m
    return f


def _unknown_group(t, m):
    t["element.99.index"] = t["element.5.index"].clone()
    m["kinds"]["99"] = "perm"
    return t, m


def _missing_tensor(t, m):
    del t["element.5.index"]
    return t, m


def _altered_structure(t, m):
    m["structure_b"] = m["structure_b"].replace('"perm", 48, 48', '"perm", 47, 47', 1)
    return t, m


CASES = {
    "repeated_index": (_idx(_repeat), ["group 5 (perm, 48x48)", "appears 2 times", "each index once"]),
    "index_out_of_range": (_idx(_out_of_range), ["group 5", "holding 48, out of range 0..47", "a permutation"]),
    "index_wrong_length": (_idx(lambda i: i[:-1]), ["group 5", "shape [47]", "expected 48 indices"]),
    "index_float": (_idx(lambda i: i.double()), ["group 5", "dtype float64", "an integer index vector"]),
    "residual_not_orthogonal": (_set("element.0", lambda E: E * 1.02),
                                ["group 0 (orthogonal, 32x32)", "saved as orthogonal", "expected an orthogonal"]),
    "residual_not_orthogonal_as_matrix": (
        _set("element.0", lambda E: E + 0.05 * torch.randn(E.shape, generator=torch.Generator().manual_seed(0)),
             "matrix", "0"), ["group 0", "not orthogonal", "expected an orthogonal matrix"]),
    "map_wrong_shape": (_set("element.4", lambda E: E[..., :7]), ["group 4 (gl", "shape [2, 8, 7]",
                                                                  "expected shape [2, 8, 8]"]),
    "map_nan": (_set("element.4", _nan), ["group 4", "1 NaN/inf values", "expected finite values"]),
    "gl_singular": (_set("element.4", _singular, "matrix", "4"), ["group 4 (gl", "ill conditioned",
                                                                   "expected an invertible matrix"]),
    "metadata_missing": (lambda t, m: (t, None), ["no 'symgraph' metadata", "symgraph-alignment/1"]),
    "metadata_not_json": (lambda t, m: (t, "{not json"), ["metadata is not JSON", "expected the"]),
    "metadata_wrong_format": (_meta(lambda m: m | {"format": "symgraph-alignment/0"}),
                              ["format 'symgraph-alignment/0'", "expected a file written by symgraph align"]),
    "metadata_missing_key": (_meta(_drop("kinds")), ["metadata key 'kinds' is missing", "expected a dict"]),
    "metadata_structure_altered": (_altered_structure, ["'structure_b' does not match 'fingerprint_b'"]),
    "unknown_group": (_unknown_group, ["group 99, which model B does not have", "elements of B's groups only"]),
    "missing_element_tensor": (_missing_tensor, ["element 5 (perm) has no tensor 'element.5.index'"]),
}


# every case through the command's entry point (``symgraph.cli.main.main``, what ``python -m
# symgraph`` runs) in one process (one import of torch instead of one per case); an exception
# that escapes it is printed as the traceback ``python -m symgraph`` would print
DRIVER = r"""
import contextlib, io, json, sys, traceback
from symgraph.cli.main import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException:
            traceback.print_exc()
            rc = 1
    out[name] = [rc, err.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refusals(ws):
    """Every case's ``apply`` (and ``python -m symgraph apply`` itself on the first, alongside),
    with the workspace's digest and listing before and after."""
    tensors, meta = _read(ws / "inputs" / "aligned" / ALIGNMENT)
    for name, (tamper, _) in CASES.items():
        t, m = tamper({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta)))
        _write(ws / "work" / f"{name}.safetensors", t, m)
    before, listing = digest(ws), sorted(os.listdir(ws / "work"))
    argv = {n: ["apply", str(ws / "work" / f"{n}.safetensors"), str(ws / "inputs" / "b"), "--out",
                str(ws / "work" / f"out_{n}")] for n in CASES}
    first = next(iter(CASES))
    real = subprocess.Popen([sys.executable, "-m", "symgraph", *argv[first]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ws / "work")
    d = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argv)], capture_output=True, text=True, env=ENV,
                       cwd=ws / "work", timeout=300)
    assert d.returncode == 0, d.stderr[-2000:]
    results = {n: subprocess.CompletedProcess(argv[n], rc, "", err)
               for n, (rc, err) in json.loads(d.stdout.splitlines()[-1]).items()}
    out, err = real.communicate(timeout=300)
    results["python -m symgraph"] = subprocess.CompletedProcess(argv[first], real.returncode, out, err)
    return results, before, digest(ws), listing, sorted(os.listdir(ws / "work"))


@pytest.mark.slow
def test_python_m_symgraph_apply_refuses_in_one_line(refusals):
    refused(refusals[0]["python -m symgraph"], "repeated_index.safetensors", *CASES["repeated_index"][1])


@pytest.mark.parametrize("name", list(CASES))
def test_a_tampered_alignment_is_refused_in_one_line(ws, refusals, name):
    results, before, after, listing, listing_after = refusals
    refused(results[name], f"{name}.safetensors", *CASES[name][1])
    assert not (ws / "work" / f"out_{name}").exists()
    assert after == before and listing_after == listing  # nothing written, nothing left behind


@pytest.fixture(scope="module")
def applied(ws):
    """``symgraph apply`` of the untampered file (rewritten by the tampering path, changing
    nothing) to b and of the full-group alignment to bt, side by side."""
    tensors, meta = _read(ws / "inputs" / "aligned" / ALIGNMENT)
    _write(ws / "work" / "untampered.safetensors", tensors, meta)
    jobs = {"ok": (ws / "work" / "untampered.safetensors", ws / "inputs" / "b"),
            "gl_out": (ws / "inputs" / "gl.safetensors", ws / "inputs" / "bt")}
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(jobs, pool.map(lambda j: run(ws, "apply", *jobs[j], "--out", ws / "work" / j), jobs)))


@pytest.mark.slow
def test_the_untampered_file_rewritten_still_applies_and_gives_b_function(ws, applied):
    r = applied["ok"]
    assert r.returncode == 0, r.stderr[-2000:]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _logits(ws / "inputs" / "b", ids)
    assert _rel(_logits(ws / "work" / "ok", ids), want) < 1e-4
    assert _rel(_logits(ws / "inputs" / "aligned", ids), want) < 1e-4  # what symgraph align wrote
    with safe_open(str(ws / "work" / "ok" / "model.safetensors"), "pt") as f, \
            safe_open(str(ws / "inputs" / "aligned" / "model.safetensors"), "pt") as g:
        assert max(float((f.get_tensor(k) - g.get_tensor(k)).abs().max()) for k in f.keys()) == 0.0


def test_full_group_elements_apply_and_carry_the_transformed_copy_back(ws, applied):
    """GL elements (not orthogonal, saved as plain matrices) and scaled rotations pass the checks:
    the transformed copy of a is carried back onto a's weights, with its own function."""
    al = symgraph.load_alignment(str(ws / "inputs" / "gl.safetensors"))
    dev = [float((E @ E.mT - torch.eye(E.shape[-1], dtype=E.dtype)).abs().max())
           for E in al.elements.values() if torch.is_tensor(E) and not getattr(E, "_symgraph_orth", False)]
    assert max(dev) > 0.1  # a GL element far from orthogonal
    r = applied["gl_out"]
    assert r.returncode == 0, r.stderr[-2000:]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    assert _rel(_logits(ws / "work" / "gl_out", ids), _logits(ws / "inputs" / "bt", ids)) < 1e-4
    with safe_open(str(ws / "work" / "gl_out" / "model.safetensors"), "pt") as f, \
            safe_open(str(ws / "inputs" / "a" / "model.safetensors"), "pt") as g:
        assert max(float((f.get_tensor(k) - g.get_tensor(k)).abs().max()) for k in f.keys()) < 1e-5

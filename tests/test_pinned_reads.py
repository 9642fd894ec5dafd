"""Checkpoint files pinned for the run (issue 60, class 1): a training job that saves B's
``model.safetensors`` again while an out-of-core merge reads it — atomically, as
``save_pretrained`` does (a temporary file, then ``os.replace``), or in place — makes the merge
refuse in one line naming the file; nothing is written, the inputs are left as they are.

The replacement is hooked deterministically: ``Checkpoint.read`` is wrapped so that after the
k-th tensor read of B the file is replaced, exactly as ``save_pretrained`` replaces it."""
from __future__ import annotations

import os
import pathlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from symgraph.checkpoints import loading
from symgraph.checkpoints.sharded import Checkpoint
from symgraph.core.files import PinnedFile
from symgraph.errors import InputError
from symgraph.testing import models

from cli_helpers import digest, main_in_process, refused

L = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=48, positions=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    models.build("llama", seed=0, **L).save_pretrained(root / "a")
    models.build("llama", seed=1, **L).save_pretrained(root / "b")
    return root


def _saved_again(path, seed=2):
    """Replace ``path`` as ``save_pretrained`` does: the new weights (another training step)
    written to a temporary name beside it, then renamed over it."""
    new = {k: v + 0.01 * (seed - 1) for k, v in load_file(str(path)).items()}
    tmp = f"{path}.tmp"
    save_file(new, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _main(cwd, *args, capsys, seconds=120):
    """``symgraph ARGS`` in this process from ``cwd`` (:func:`cli_helpers.main_in_process`)."""
    return main_in_process(pathlib.Path(cwd), *args, cwd=".", capsys=capsys, seconds=seconds)


@pytest.mark.parametrize("k", [1, 5])
def test_checkpoint_replaced_mid_merge_is_refused(pair, tmp_path, monkeypatch, capsys, k):
    """B's model.safetensors is saved again after B's k-th tensor read (k=1: while aligning;
    k=5: later): exit 2, one line naming the file and saying it changed, ``--out`` never
    created, no temporary directory left, A untouched, B as the 'training job' left it."""
    a, b = tmp_path / "a", tmp_path / "b"
    for src, dst in ((pair / "a", a), (pair / "b", b)):
        dst.mkdir()
        for f in os.listdir(src):
            (dst / f).write_bytes((src / f).read_bytes())
    work = tmp_path / "work"
    work.mkdir()
    target = str(b / "model.safetensors")
    real_read, reads = Checkpoint.read, []

    def read(self, key, *args, **kw):
        t = real_read(self, key, *args, **kw)
        if self.path == str(b):
            reads.append(key)
            if len(reads) == k:
                _saved_again(target)
        return t
    monkeypatch.setattr(Checkpoint, "read", read)
    before_a = digest(a)
    r = _main(work, "merge", a, b, "--out", work / "o", "--memory-budget", "1MB", capsys=capsys)
    refused(r, f"{target}' changed during the run", "another file took its name", "nothing was written")
    assert len(reads) == k  # refused at the next read of B, not later
    assert os.listdir(work) == []  # --out not created, no temporary directory left beside it
    assert digest(a) == before_a
    replaced = load_file(target)
    assert not torch.equal(replaced["model.norm.weight"], load_file(str(pair / "b" / "model.safetensors"))["model.norm.weight"])
    assert sorted(os.listdir(b)) == sorted(os.listdir(pair / "b"))  # nothing added to or taken from B


def test_unchanged_checkpoints_still_merge(pair, tmp_path, capsys):
    """The pins refuse nothing when nothing changes (and the merged tensors are the average)."""
    r = _main(tmp_path, "merge", pair / "a", pair / "b", "--align", "none", "--out", tmp_path / "o",
              "--memory-budget", "1MB", capsys=capsys)
    assert r.returncode == 0, r.stderr
    got, ta, tb = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "o", pair / "a", pair / "b"))
    k = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(got[k], (ta[k] + tb[k]) / 2)


def test_rewritten_in_place_is_refused(pair, tmp_path):
    """A file rewritten in place (same inode, new bytes) is refused at the next read too."""
    b = tmp_path / "b"
    b.mkdir()
    for f in os.listdir(pair / "b"):
        (b / f).write_bytes((pair / "b" / f).read_bytes())
    ckpt = Checkpoint(str(b))
    key = ckpt.keys[0]
    first = ckpt.read(key)
    path = b / "model.safetensors"
    ino = os.stat(path).st_ino
    with open(path, "r+b") as f:  # the last bytes of the data changed, the size kept
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x80\x3f")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a coarse clock cannot hide it
    assert os.stat(path).st_ino == ino
    with pytest.raises(InputError, match="changed during the run .it was rewritten in place"):
        ckpt.read(key)
    assert torch.equal(first, load_file(str(pair / "b" / "model.safetensors"))[key])


def test_a_pinned_file_reads_the_version_it_opened(tmp_path):
    """The pin's reader opens the file it pinned, not what now has its name: a read racing a
    replacement sees one version wholly; the check then refuses the replaced file."""
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(3)}, str(path))
    pin = PinnedFile(str(path))
    pin.check()
    _saved_again(str(path), seed=101)  # x becomes 2.0 everywhere
    with safe_open(pin.reader, framework="pt") as h:
        assert torch.equal(h.get_tensor("x"), torch.ones(3))
    assert torch.equal(load_file(str(path))["x"], torch.full((3,), 2.0))
    with pytest.raises(InputError, match=r"w.safetensors' changed during the run \(another file took its name"):
        pin.check()
    os.unlink(path)
    with pytest.raises(InputError, match="it is gone"):
        pin.check()


def test_loading_refuses_a_file_replaced_after_its_headers(pair, tmp_path, monkeypatch):
    """In memory: the checkpoint saved again between the header check and ``from_pretrained``
    is refused after the load (the loaded weights would not be those checked)."""
    b = tmp_path / "b"
    b.mkdir()
    for f in os.listdir(pair / "b"):
        (b / f).write_bytes((pair / "b" / f).read_bytes())
    real = loading._from_pretrained

    def load(*args, **kw):
        _saved_again(str(b / "model.safetensors"))
        return real(*args, **kw)
    monkeypatch.setattr(loading, "_from_pretrained", load)
    with pytest.raises(InputError, match="model.safetensors' changed during the run"):
        loading.load_local(str(b))


def test_without_a_handle_to_spare_the_path_is_pinned(tmp_path, monkeypatch):
    """At the process's file limit (EMFILE) the identity is taken from the path and checked
    the same way: a replacement is still refused."""
    import errno
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(3)}, str(path))
    real_open = os.open

    def full(p, *a, **k):
        if str(p) == str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(p, *a, **k)
    monkeypatch.setattr(os, "open", full)
    pin = PinnedFile(str(path))
    monkeypatch.setattr(os, "open", real_open)
    assert pin.fd is None and pin.reader == str(path)
    pin.check()
    _saved_again(str(path))
    with pytest.raises(InputError, match="another file took its name"):
        pin.check()

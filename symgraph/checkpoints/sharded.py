"""Safetensors checkpoints read and written one tensor at a time.

:class:`Checkpoint` opens a ``save_pretrained`` directory (one ``model.safetensors`` or shards
with ``model.safetensors.index.json``): its model is built on the ``meta`` device from the
config (no weights), the tensors are checked against it from the file headers alone (every
parameter present, tied names counting once; no unused tensor; shapes as the config says),
and each tensor is read, through safetensors' ``safe_open``, only when asked for, from the
file pinned when its header was read (:class:`~symgraph.core.files.PinnedFile`): a file
replaced or rewritten during the run is refused, never read as a mix of two versions.
:class:`ShardWriter` writes tensors whose names, shapes and dtypes are known in advance into
shards named and indexed as ``save_pretrained`` names them, one tensor at a time;
:class:`CheckpointWriter` a whole checkpoint directory: the shards, then the config.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import torch

from ..core.devices import computed_buffers
from .converted import Conversion, refuse_conversion
from ..core.dtypes import SAFETENSORS_NAMES as _ST_NAMES
from .loading import (KeysDiffer, build_meta, check_checkpoint_dir, check_tensors,
                      read_config, read_layout)
from .layout import read_pinned
from ..core.finite import check_read
from ..core.ties import parameter_names, untie
from ..errors import InputError

__all__ = ["Checkpoint", "KeysDiffer", "check_pair", "ShardWriter", "CheckpointWriter", "parse_size", "shard_writer",
           "write_config", "EXTRA_FILES", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def parse_size(size) -> int:
    """Bytes from an int or a string such as ``"2GB"``, ``"500MB"``, ``"4096"`` (bytes; kB, MB, GB
    and TB powers of 1000 as ``save_pretrained``; KiB, MiB, GiB and TiB powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    s = str(size).strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10 ** 3, "MB": 10 ** 6,
             "GB": 10 ** 9, "TB": 10 ** 12, "B": 1}
    for u, f in [*units.items(), ("", 1)]:  # a bare number: bytes
        if s.endswith(u):
            try:
                v = float(s[: len(s) - len(u)])
            except ValueError:
                continue
            if 0 < v < float("inf") and v * f < float("inf"):
                return int(v * f)
            break
    raise InputError(f"size {size!r}; expected a positive size such as '2GB' or '500MB' (units B, kB, MB, GB, TB, "
                     "KiB, MiB, GiB, TiB; a bare number is bytes)")

def check_pair(A, B, a: str = "A", b: str = "B", width: str | None = "expected two models of one architecture "
               "and width") -> None:
    """Refuse two :class:`Checkpoint` s (named ``a`` and ``b`` in the message) that are not one
    architecture (their classes differ) or, unless ``width`` is None, not one width (a tensor's
    shape or presence differs; ``width`` says what is expected)."""
    if A.cls is not B.cls:
        raise InputError(f"{a!r} is a {A.cls.__name__} but {b!r} is a {B.cls.__name__}; expected models "
                         "of one architecture")
    if width is not None and A.shapes != B.shapes:
        k = sorted(k for k in set(A.shapes) | set(B.shapes) if A.shapes.get(k) != B.shapes.get(k))[0]
        raise InputError(f"{a!r} and {b!r} differ in tensor {k!r} ({A.shapes.get(k, 'missing')} vs "
                         f"{B.shapes.get(k, 'missing')}); {width}")


class Checkpoint:
    """A ``save_pretrained`` directory read tensor by tensor.

    ``model``: the architecture on the ``meta`` device (no weights), in the checkpoint's
    dtype; ``params``: parameter name → the names it goes by (tied weights share one);
    ``keys``: the checkpoint's tensor names in file order; :meth:`get` reads a parameter,
    :meth:`read` a checkpoint tensor. ``layout``: its :func:`read_layout`, when the caller has
    read the headers already.
    """

    def __init__(self, path: str, layout=None):
        check_checkpoint_dir(path)
        self.path = path
        self.config, self.cls = read_config(path)
        layout = layout or read_layout(path)  # the headers (checked to agree with the index), or the caller's
        self.dtype = layout.dtype
        self.model = build_meta(self.cls, self.config, layout, os.path.join(path, "config.json"))
        self.conversion: Conversion | None = None  # the checkpoint stored as transformers converts on load
        try:
            self.params = check_tensors(self.model, layout, path)
        except KeysDiffer:
            self.conversion = Conversion.of(self.model, layout)
            if self.conversion is None:
                refuse_conversion(self.model, layout, repr(path))
                raise
            layout = self.conversion.layout  # the model's names, each read through the conversion
            self.params = check_tensors(self.model, layout, path)
        self.files, self.shapes, self.dtypes, self.keys = layout.files, layout.shapes, layout.dtypes, layout.keys
        self.pins = layout.pins  # shard path -> the file opened with the headers (a read checks it)
        self._finite: set = set()  # tensors already checked finite (alignment reads them again per sweep)
        self.key_of = {n: next(a for a in names if a in self.shapes) for n, names in self.params.items()}
        self.param_of = {a: n for n, names in self.params.items() for a in names}
        self._computed: dict[str, torch.Tensor] | None = None  # buffers the constructor computes (fetch builds them once)
        self._stored: dict[str, str] = {}  # a key the files lack (an untied name) -> the key it is read from
        self.source: Checkpoint | None = None  # the checkpoint as stored, when this one reads it as another model

    def untied(self, model=None) -> Checkpoint:
        """This checkpoint read as ``model``: its meta :attr:`model` with tied parameters made
        separate (:func:`symgraph.core.ties.untie` of it, the default). Every parameter of ``model`` has
        a key: one of its names the files hold, else its first name (as ``save_pretrained`` of
        the untied model names it), read from the tensor that name had here (its tied group's
        stored key); ``keys`` (appended in ``model``'s order), ``shapes`` and ``dtypes`` list
        those keys, so that a writer writes each; ``source`` is this checkpoint, left untouched."""
        model = untie(self.model) if model is None else model
        out = copy.copy(self)
        out.model, out.config, out.source = model, getattr(model, "config", self.config), self.source or self
        out.params = parameter_names(model)
        out.shapes, out.dtypes, out.files = dict(self.shapes), dict(self.dtypes), dict(self.files)
        out.keys, out._stored, out._finite = list(self.keys), dict(self._stored), set(self._finite)
        for name, names in out.params.items():
            if not any(a in self.shapes for a in names):
                src = self.key(name)
                out.shapes[name], out.dtypes[name], out.files[name] = self.shapes[src], self.dtypes[src], self.files[src]
                out._stored[name] = self._stored.get(src, src)
                out.keys.append(name)
        out.key_of = {n: next(a for a in names if a in out.shapes) for n, names in out.params.items()}
        out.param_of = {a: n for n, names in out.params.items() for a in names}
        return out

    def retyped(self, dtype) -> torch.nn.Module:
        """The meta model in ``dtype`` (graphs of checkpoints stored in different dtypes run in one)."""
        return self.model.to(dtype)

    # --- reading -------------------------------------------------------------------------

    def check_unchanged(self) -> None:
        """Refuse (one line, naming the file) a shard replaced or rewritten since it was pinned."""
        for pin in self.pins.values():
            pin.check()

    def read(self, key: str, check: bool = True, part=None) -> torch.Tensor:
        """A checkpoint tensor (a copy), checked finite unless ``check=False`` (the caller
        checks what it computes from it); ``part=(dim, start, stop)`` reads that slice only.
        The file is mapped only for the read: pages of a mapping that stays open count as the
        process's resident memory, and over a whole model would add up to its size. It is the
        file pinned with the headers, checked unchanged before and after the read."""
        stored = self._stored.get(key, key)
        if self.conversion is not None and stored in self.conversion.group_of:  # read whole, then sliced
            t = self.conversion.read(stored, lambda k: self._stored_tensor(self.conversion.source.files[k], k, None))
            if part is not None:
                d, start, stop = part
                t = t[(slice(None),) * d + (slice(start, stop),)].clone()
        else:
            t = self._stored_tensor(self.files[key], stored, part)
        if check:
            check_read(t, key, self._finite, part is None, f"checkpoint {self.path!r}")
        return t

    def _stored_tensor(self, file, stored: str, part) -> torch.Tensor:
        """The tensor ``stored`` of ``file`` (``part``: as :meth:`read`), through its pin."""
        return read_pinned(self.pins, file, stored, part, self.path)

    def fetch(self, name: str) -> torch.Tensor:
        """A graph attribute of the model by name, for running it out of core
        (:class:`~symgraph.alignment.graphrun.Stepper`): a parameter or persistent buffer
        read from the file; a buffer the checkpoint does not hold (computed by the model's
        constructor, e.g. rotary frequencies) as the constructor computes it on the CPU."""
        key = self.key(name)
        if key in self.files:
            return self.read(key, check=False)
        if self._computed is None:
            self._computed = computed_buffers(self.cls, self.config)
        if name not in self._computed:
            raise InputError(f"{self.path!r} has no tensor {name!r} and the model does not compute one; "
                             "expected a complete checkpoint")
        return self._computed[name]

    def key(self, name: str) -> str:
        """The checkpoint key of the parameter ``name`` (any of its tied names) or buffer ``name``."""
        return self.key_of.get(self.param_of.get(name, name), name)

    def get(self, name: str, check: bool = True, part=None) -> torch.Tensor:
        """The parameter ``name`` (any of its tied names), or the buffer ``name``; ``part``:
        as :meth:`read`."""
        return self.read(self.key(name), check, part)

def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 1


def _pwrite(fd, data, at) -> None:
    while len(data):
        k = os.pwrite(fd, data, at)
        data, at = data[k:], at + k


class ShardWriter:
    """The output shards, written one tensor at a time.

    The tensors, their shapes and dtypes are known before any value (the anchor's
    checkpoint), so each shard's safetensors header is written when it is opened and every
    tensor is written at its place as it is computed, in any order: memory holds one tensor,
    not a shard (``save_file`` would build the whole shard in memory). ``limit`` (bytes): shards
    of at most that many bytes in ``plan`` order (a larger tensor gets its own), named and
    indexed as ``save_pretrained`` names them (one ``model.safetensors`` when everything fits
    one); or ``layout``: ``[(file name, [keys])]``, the shards of an input to copy. Files are
    read back by ``safe_open``.
    """

    PENDING = 2  # values written by the writer thread while the next ones are computed

    def __init__(self, directory, limit, plan, layout=None):
        self.dir = directory
        info = {key: (tuple(shape), dtype, int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype))
                for key, shape, dtype in plan}
        if layout is None:
            shards, cur, size = [], [], 0
            for key, (*_, n) in info.items():
                if cur and size + n > limit:
                    shards.append(cur)
                    cur, size = [], 0
                cur.append(key)
                size += n
            shards.append(cur)
            k = len(shards)
            self.names = [SINGLE if k == 1 else f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
        else:
            self.names, shards = [n for n, _ in layout], [list(keys) for _, keys in layout]
            if sorted(k for sh in shards for k in sh) != sorted(info):
                raise RuntimeError("shard layout does not hold exactly the planned tensors")  # a bug
        self.shards = [[(key, *info[key]) for key in sh] for sh in shards]
        self.shard_of = {key: i for i, sh in enumerate(shards) for key in sh}
        self.total = sum(n for *_, n in info.values())
        self._info = info
        self._files: dict = {}
        self._where: dict = {}  # key -> (shard, data offset in its file)
        self._rows = {key: 0 for key in info}
        self._pending: list = []  # writes under way (futures)
        self._writer = None

    def add(self, key, t):
        """Write ``key``'s value ``t``: the whole tensor, or consecutive slices of it along
        dim 0 (rows are contiguous in the file), so that a large tensor computed in slices
        is never held whole."""
        i = self.shard_of[key]
        if i not in self._files:
            self._open(i)
        shape, dtype, n = self._info[key]
        rows, total = (t.shape[0], shape[0]) if shape else (1, 1)
        done = self._rows[key]
        if t.dtype != dtype or t.dim() != len(shape) or tuple(t.shape[1:]) != shape[1:] or done + rows > total:
            raise RuntimeError(f"shard writer expected {key} {shape} {dtype} (rows {done}:), got "
                               f"{key} {tuple(t.shape)} {t.dtype}")  # a bug, not bad input
        data = memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
        at = self._where[key] + (n // total) * done if total else self._where[key]
        self._rows[key] = done + rows
        while len(self._pending) >= self.PENDING:  # at most this many values held for writing
            self._pending.pop(0).result()
        self._pending.append(self._pool().submit(_pwrite, self._files[i].fileno(), data, at))

    def _pool(self):
        """The one thread that writes (``os.pwrite`` releases the GIL: the next tensor is
        computed meanwhile; a disk slower than the merge holds :attr:`PENDING` values)."""
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="symgraph-write")
        return self._writer

    def _drain(self) -> None:
        """Wait for every pending write (the first failure raised, once all have ended)."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        for e in errors:
            if e is not None:
                raise e

    def _open(self, i):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype, n in self.shards[i]:
            header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        f = open(os.path.join(self.dir, self.names[i]), "wb")
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.flush()
        base = 8 + len(raw)
        for key, shape, dtype, n in self.shards[i]:
            self._where[key] = base
            base += n
        self._files[i] = f

    def close(self) -> dict:
        self._drain()
        for i in range(len(self.shards)):  # a shard of empty tensors only still gets its header
            if i not in self._files:
                self._open(i)
        missing = [key for sh in self.shards for key, shape, _, _ in sh
                   if self._rows[key] != (shape[0] if shape else 1)]
        for f in self._files.values():
            f.close()
        self._files = {}
        if missing:
            raise RuntimeError(f"shard writer: {missing[0]} was not written in full")  # a bug
        if len(self.shards) > 1:
            weight_map = {key: self.names[i] for key, i in self.shard_of.items()}
            with open(os.path.join(self.dir, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return {"tensors": len(self.shard_of), "bytes": self.total, "shards": len(self.shards)}


def shard_writer(ckpt, directory, limit, plan, layout=None):
    """A :class:`ShardWriter` of ``plan`` (``[(key, shape, dtype)]``: ``ckpt``'s tensors, as its
    model names them) into ``directory``, with ``limit`` or ``layout`` as there; for a checkpoint
    stored as transformers converts on load (``ckpt.conversion``), a writer that stores them as
    ``ckpt`` did (:class:`~.converted.ConvertingWriter`; ``layout`` is then ``ckpt``'s own)."""
    conversion = getattr(ckpt, "conversion", None)
    if conversion is None:
        return ShardWriter(directory, limit, list(plan), layout)
    source = conversion.source
    own = None if layout is None else input_shards(source.keys, source.files)
    return conversion.writer(plan, lambda real: ShardWriter(directory, limit, real, own))


def input_shards(keys, files) -> list:
    """``[(file name, [keys])]``: the shards ``keys`` are in (``files``: key -> path), for an
    output split and named as its input was."""
    shards: dict = {}
    for k in keys:
        shards.setdefault(os.path.basename(files[k]), []).append(k)
    if len(shards) == 1:
        return [(SINGLE, next(iter(shards.values())))]
    return list(shards.items())


class CheckpointWriter:
    """A checkpoint of ``ckpt``'s architecture written into ``directory``: the tensors of ``plan``
    (``[(key, shape, dtype)]``) in shards (:func:`shard_writer`, with ``limit`` or ``layout``),
    then on :meth:`close` ``ckpt``'s config with ``updates`` (:func:`write_config`)."""

    def __init__(self, ckpt, directory: str, limit, plan, updates: dict | None = None, layout=None):
        self.shards = shard_writer(ckpt, directory, limit, plan, layout)
        self.ckpt, self.directory, self.updates = ckpt, directory, updates
        self.add = self.shards.add

    def close(self) -> dict:
        info = self.shards.close()
        write_config(self.ckpt.path, self.directory, self.updates, self.ckpt.dtypes.values())
        return info


#: Files of the anchor's directory copied beside the output's ``config.json``.
EXTRA_FILES = ("generation_config.json",)


def write_config(source_dir: str, directory: str, updates: dict | None, dtypes=()) -> None:
    """The anchor's ``config.json`` (from ``source_dir``) into ``directory``, with the fields the
    merge changes (``updates``; a dict value updates a nested config such as ``text_config``),
    and its :data:`EXTRA_FILES`. ``dtypes``: the written tensors' (``torch.float32``, ...); a
    ``dtype`` or ``torch_dtype`` the config states that none of them has is stale (transformers
    loads by it: ``float8_e4m3fn`` over float32 tensors cannot load) and becomes their most
    common floating-point dtype (the first by name on a tie). A checkpoint of mixed dtypes keeps a dtype it has."""
    for fn in EXTRA_FILES:
        if os.path.isfile(os.path.join(source_dir, fn)):
            shutil.copy2(os.path.join(source_dir, fn), os.path.join(directory, fn))
    src, dst = os.path.join(source_dir, "config.json"), os.path.join(directory, "config.json")
    with open(src, encoding="utf-8") as f:
        config = json.load(f)
    floats = [str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point]
    updates = {**(updates or {}), **{k: max(sorted(set(floats)), key=floats.count) for k in ("dtype", "torch_dtype")
                                     if floats and k in config and config[k] not in floats}}
    if not updates:
        shutil.copy2(src, dst)
        return
    for k, v in updates.items():
        config[k] = {**config[k], **v} if isinstance(v, dict) and isinstance(config.get(k), dict) else v
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

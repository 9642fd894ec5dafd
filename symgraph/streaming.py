"""Out-of-core merging: checkpoints read tensor by tensor, never a whole model in memory.

A :class:`Checkpoint` is a ``save_pretrained`` directory (one ``model.safetensors`` or shards
with ``model.safetensors.index.json``) opened with safetensors' ``safe_open`` (memory-mapped):
its model is built on the ``meta`` device from the config, for the analysis, and every tensor
is read when it is needed. The checkpoint is checked completely from the headers before any
work: every parameter present (tied names count once), no unused tensor, shapes as the config
says; values are checked finite when read.

:class:`StreamingMerge` analyses the anchor's meta model, aligns every other checkpoint by
weight matching (:func:`symgraph.alignment.driver.align_weights`) through lazy, norm-folded
views of the tensors (:class:`Folded`, a bounded cache), then writes the merge one tensor
group at a time (a norm fold's gain, shift and readers move together; every other tensor
alone): each model's tensors are moved into the anchor's basis, averaged in float32, cast to
the anchor checkpoint's dtype for that tensor and appended to the current output shard;
shards of at most ``max_shard_size`` bytes are written with ``safetensors.torch.save_file``
and indexed by ``model.safetensors.index.json`` as ``save_pretrained`` does. Peak memory is
about one shard plus a few layers' tensors, whatever the model's size.

:func:`merge_checkpoints` is the Python entry (``symgraph merge`` uses it for plain averages
with ``--align weights`` or ``none``); activation statistics, Fisher, RegMean, REPAIR and
learned matching still load the models (:func:`symgraph.merge`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from tqdm import tqdm

from .apply import move
from .checkpoints import EXPECTED, _model_class, _names, _quiet_transformers, check_checkpoint_dir
from .errors import InputError
from .folding import gauge, members

__all__ = ["Checkpoint", "KeysDiffer", "Folded", "StreamingMerge", "merge_checkpoints", "parse_size"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD = 2 << 30  # bytes per output shard
DEFAULT_CACHE = 1 << 30  # bytes of folded tensors kept per model while aligning
EXTRA_FILES = ("generation_config.json",)


class KeysDiffer(InputError):
    """The checkpoint's tensor names are not the built model's (transformers renames or
    converts them on load, e.g. fused MoE experts): it can only be merged after
    ``from_pretrained``."""


def parse_size(size) -> int:
    """Bytes from an int or a string such as ``"2GB"``, ``"500MB"`` (powers of 1000 as
    ``save_pretrained``; ``GiB``/``MiB`` powers of 1024)."""
    if isinstance(size, int) and size > 0:
        return size
    s = str(size).strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "B": 1}
    for u, f in units.items():
        if s.endswith(u):
            try:
                v = float(s[: -len(u)])
            except ValueError:
                break
            if v > 0:
                return int(v * f)
    raise InputError(f"shard size {size!r}; expected a positive size such as '2GB' or '500MB'")


class Checkpoint:
    """A ``save_pretrained`` directory read tensor by tensor.

    ``model``: the architecture on the ``meta`` device (no weights), in the checkpoint's
    dtype; ``params``: parameter name → the names it goes by (tied weights share one);
    ``keys``: the checkpoint's tensor names in file order; :meth:`get` reads a parameter,
    :meth:`read` a checkpoint tensor.
    """

    def __init__(self, path: str):
        check_checkpoint_dir(path)
        self.path = path
        tf = _quiet_transformers()
        cfg_path = os.path.join(path, "config.json")
        try:
            self.config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read {cfg_path}: {' '.join(str(e).split())[:200]}; expected a "
                             "Hugging Face config written by save_pretrained") from None
        self.cls = _model_class(tf, self.config, cfg_path)
        self.files = self._files()
        self.keys = list(self.files)
        self.shapes, self.dtypes = {}, {}
        for file in dict.fromkeys(self.files.values()):
            with self._handle(file) as h:
                for key in h.keys():
                    if self.files.get(key) == file:
                        sl = h.get_slice(key)
                        self.shapes[key], self.dtypes[key] = tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype())
        absent = sorted(set(self.files) - set(self.shapes))
        if absent:
            raise InputError(f"{self.path!r}: tensor(s) {_names(absent)} are in the index but not in "
                             "their shard; expected a complete checkpoint")
        floats = [self.dtypes[k] for k in self.keys if self.dtypes[k] is not None and self.dtypes[k].is_floating_point]
        self.dtype = max(set(floats), key=floats.count) if floats else torch.float32
        with torch.device("meta"):
            self.model = self.cls(self.config).to(self.dtype).eval()
        self.params = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            self.params.setdefault(id(p), []).append(name)
        self.params = {names[0]: names for names in self.params.values()}
        self._check_complete()
        self.key_of = {n: next(a for a in names if a in self.shapes) for n, names in self.params.items()}
        self.param_of = {a: n for n, names in self.params.items() for a in names}

    # --- reading -------------------------------------------------------------------------

    def _files(self) -> dict:
        from safetensors import safe_open
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InputError(f"cannot read {index!r} ({e}); expected the index save_pretrained "
                                 "writes ({'weight_map': {tensor: shard file}})") from None
            files = {k: os.path.join(self.path, v) for k, v in weight_map.items()}
            absent = sorted({v for v in files.values() if not os.path.isfile(v)})
            if absent:
                raise InputError(f"{index!r} names shard(s) that are not there ({_names(absent)}); "
                                 "expected every shard of the checkpoint")
            return files
        single = os.path.join(self.path, SINGLE)
        try:
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (truncated, corrupt header)
            raise InputError(f"cannot read the weights of {self.path!r}: {' '.join(str(e).split())[:200]}; "
                             "expected valid safetensors files written by save_pretrained") from None

    def _handle(self, file):
        from safetensors import safe_open
        try:
            return safe_open(file, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read {file!r}: {' '.join(str(e).split())[:200]}; expected "
                             "valid safetensors files written by save_pretrained") from None

    def read(self, key: str, check: bool = True) -> torch.Tensor:
        """A checkpoint tensor (a copy), checked finite unless ``check=False`` (the caller
        checks what it computes from it). The file is mapped only for the read: pages of a
        mapping that stays open count as the process's resident memory, and over a whole
        model would add up to its size."""
        with self._handle(self.files[key]) as h:
            t = h.get_tensor(key)
        if check and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise InputError(f"checkpoint {self.path!r} has {bad} NaN/inf values in tensor {key!r}; "
                             "expected finite weights (was the model trained with a diverging loss?)")
        return t

    def get(self, name: str, check: bool = True) -> torch.Tensor:
        """The parameter ``name`` (any of its tied names)."""
        return self.read(self.key_of[self.param_of.get(name, name)], check)

    def nbytes(self, key: str) -> int:
        return int(np.prod(self.shapes[key], dtype=np.int64)) * _itemsize(self.dtypes[key])

    # --- checks --------------------------------------------------------------------------

    def _check_complete(self):
        """Refuse (naming the tensors) a checkpoint without some parameter, with tensors the
        model does not use, or with shapes other than the config's: before reading any value."""
        expected = set(self.model.state_dict().keys())
        unused = sorted(set(self.shapes) - expected)
        missing = sorted(names[0] for names in self.params.values() if not any(a in self.shapes for a in names))
        cls = self.cls.__name__
        if unused or missing:
            parts = []
            if missing:
                parts.append(f"{len(missing)} parameter(s) of {cls} are not in the checkpoint ({_names(missing)})")
            if unused:
                parts.append(f"{len(unused)} checkpoint tensor(s) are not {cls}'s ({_names(unused)})")
            raise KeysDiffer(f"refusing {self.path!r}: " + "; ".join(parts) + f"; expected {EXPECTED} "
                             f"holding exactly the tensors of {cls}")
        sd = self.model.state_dict()
        resized = sorted(k for k in self.shapes if tuple(sd[k].shape) != self.shapes[k])
        if resized:
            k = resized[0]
            raise InputError(f"refusing {self.path!r}: {len(resized)} tensor(s) have other shapes than the "
                             f"config says ({_names(resized)}; {k!r} is {self.shapes[k]}, the config gives "
                             f"{tuple(sd[k].shape)}); expected the checkpoint of this config")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 1


class Folded(Mapping):
    """Parameter name → tensor of a :class:`Checkpoint` with the report's norm gains folded
    (what the symmetry classes act on), read on demand. A fold's tensors are read and folded
    together; the most recently used values are kept up to ``budget`` bytes."""

    def __init__(self, report, ckpt: Checkpoint, budget: int = DEFAULT_CACHE, dtype=torch.float64):
        self.report, self.ckpt, self.budget, self.dtype = report, ckpt, budget, dtype
        self.unit = {n: members(f) for f in report.folds for n in members(f)}
        self._cache: OrderedDict = OrderedDict()
        self._bytes = 0
        self.reads = 0

    def __getitem__(self, name):
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        names = self.unit.get(name, (name,))
        raw = {n: self.ckpt.get(n) for n in names}
        self.reads += len(raw)
        vals = raw | {k: v.to(raw[k].dtype) for k, v in self.report.fold(raw, self.dtype).items()}
        for n, v in vals.items():
            self._put(n, v)
        return vals[name]

    def _put(self, name, v):
        size = v.numel() * v.element_size()
        if size > self.budget:
            return
        if name in self._cache:
            old = self._cache.pop(name)
            self._bytes -= old.numel() * old.element_size()
        self._cache[name] = v
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def __iter__(self):
        return iter(self.report.parameters)

    def __len__(self):
        return len(self.report.parameters)


class StreamingMerge:
    """Analyse, align and write a merge of checkpoints without loading any of them whole.

    ``paths``: two or more ``save_pretrained`` directories of one architecture; ``align``:
    "weights" or None; ``weights``: mixing weights (uniform by default). The constructor reads
    headers only; :meth:`align` solves; :meth:`write` writes the merged checkpoint into a
    directory (``save_atomic`` passes its temporary one).
    """

    def __init__(self, paths, *, weights=None, align="weights", anchor: int = 0, fold_norms: bool = True,
                 max_shard_size=DEFAULT_SHARD, progress: bool = False, cache_bytes: int = DEFAULT_CACHE,
                 **align_options):
        paths = list(paths)
        if len(paths) < 2:
            raise InputError(f"merge needs at least 2 checkpoints, got {len(paths)}")
        if align not in ("weights", None, "none"):
            raise InputError(f"out-of-core merging aligns by weights or not at all, got align={align!r}; "
                             "activation alignment loads the models (symgraph.merge)")
        if not 0 <= anchor < len(paths):
            raise InputError(f"anchor={anchor} is not one of the {len(paths)} checkpoints")
        w = np.ones(len(paths)) if weights is None else np.asarray(weights, float)
        if w.shape != (len(paths),) or not np.isfinite(w).all() or w.sum() <= 0:
            raise InputError(f"weights must be {len(paths)} finite numbers with a positive sum, got {weights!r}")
        self.weights = w / w.sum()
        self.align_mode = None if align in (None, "none") else align
        self.anchor, self.fold_norms, self.progress = anchor, fold_norms, progress
        self.shard_bytes, self.cache_bytes = parse_size(max_shard_size), cache_bytes
        self.align_options = align_options
        self.ckpts = [Checkpoint(p) for p in paths]
        self._check_family()
        # rotations are solved and applied in float32 for 16- and 32-bit weights (their own
        # precision is far coarser), in float64 for float64 checkpoints
        self.work_dtype = torch.float64 if any(c.dtype == torch.float64 for c in self.ckpts) else torch.float32
        self.alignments: list = [None] * len(paths)
        self.report = None
        self.timings: dict = {}

    def _check_family(self):
        A = self.ckpts[self.anchor]
        for c in self.ckpts:
            if c.cls is not A.cls:
                raise InputError(f"{A.path!r} is a {A.cls.__name__} but {c.path!r} is a {c.cls.__name__}; "
                                 "expected models of one architecture")
            if self.align_mode is None:
                other = sorted(k for k in A.shapes if c.shapes.get(k) != A.shapes[k])
                if other or set(c.shapes) != set(A.shapes):
                    k = (other or sorted(set(c.shapes) ^ set(A.shapes)))[0]
                    raise InputError(f"{c.path!r} and the anchor {A.path!r} differ in tensor {k!r} "
                                     f"({c.shapes.get(k)} vs {A.shapes.get(k)}); without alignment the "
                                     "checkpoints must have the same tensors and shapes (models of "
                                     "different widths need --align weights)")

    def align(self):
        """Analyse the anchor's meta model and solve every other checkpoint by weights."""
        from .alignment.driver import align_weights
        from .api import analyze
        t0 = time.perf_counter()
        A = self.ckpts[self.anchor]
        if self.align_mode is None:  # nothing to move: every tensor is averaged as it is
            return self.alignments
        ra = analyze(A.model, fold_norms=self.fold_norms)
        self.report = ra
        self.timings["analyze"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        fa = Folded(ra, A, self.cache_bytes, self.work_dtype)
        gains = gauge(ra.folds, {n: A.get(n) for f in ra.folds for n in (f.gain, f.shift) if n})
        with tqdm(total=len(self.ckpts) - 1, desc="aligning", unit="model", file=sys.stderr,
                  leave=False, disable=not self.progress) as bar:
            for i, c in enumerate(self.ckpts):
                if i == self.anchor:
                    continue
                same = {n: tuple(p.shape) for n, p in c.model.named_parameters()} == \
                       {n: tuple(p.shape) for n, p in A.model.named_parameters()}
                rb = ra if same else analyze(c.model, fold_norms=self.fold_norms)
                self.alignments[i] = align_weights(ra, rb, fa, Folded(rb, c, self.cache_bytes, self.work_dtype), gains,
                                                   exact_dtype=self.work_dtype, **self.align_options)
                bar.update()
        self.timings["align"] = time.perf_counter() - t1
        return self.alignments

    def write(self, directory: str) -> dict:
        """Write the merged checkpoint into ``directory`` (shards, index, config); returns
        ``{"tensors": n, "bytes": total, "shards": k}``."""
        if self.report is None and self.align_mode is not None:
            self.align()
        t0 = time.perf_counter()
        A = self.ckpts[self.anchor]
        order, seen = [], set()  # (anchor keys, parameters merged for them or None: a buffer)
        for key in A.keys:
            if key in seen:
                continue
            name = A.param_of.get(key)
            names = self._unit(name) if name is not None else None
            keys = (key,) if names is None else tuple(k for n in names for k in A.params[n] if k in A.shapes)
            order.append((keys, names))
            seen.update(keys)
        writer = _ShardWriter(directory, self.shard_bytes,
                              [(k, A.shapes[k], A.dtypes[k]) for keys, _ in order for k in keys])
        with tqdm(total=len(A.keys), desc="writing", unit="tensor", file=sys.stderr, leave=False,
                  disable=not self.progress) as bar:
            for keys, names in order:
                if names is None:  # a buffer: the anchor's
                    out = {keys[0]: A.read(keys[0])}
                else:
                    out = {k: v for n, v in self._merged(names).items() for k in A.params[n]}
                for k in keys:
                    writer.add(k, out[k])
                    bar.update()
        info = writer.close()
        shutil.copy2(os.path.join(A.path, "config.json"), os.path.join(directory, "config.json"))
        for fn in EXTRA_FILES:
            src = os.path.join(A.path, fn)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(directory, fn))
        self.timings["write"] = time.perf_counter() - t0
        return info

    def _unit(self, name) -> tuple:
        """The parameters moved together with ``name``: its fold's, or itself."""
        for f in self.report.folds if self.report is not None else ():
            if name in members(f):
                return members(f)
        return (name,)

    def _merged(self, names) -> dict:
        """Merged values of ``names`` in the anchor's dtypes: each model's tensors moved into
        the anchor's basis (float64 where a map acts), averaged in float32."""
        A = self.ckpts[self.anchor]
        # inputs are checked finite through the result (NaN and inf survive averaging and
        # maps); only a non-finite result makes us look for the input that caused it
        own = {n: A.get(n, check=False) for n in names}
        acc = {n: torch.zeros(v.shape, dtype=torch.promote_types(v.dtype, torch.float32)) for n, v in own.items()}
        for i, (c, w) in enumerate(zip(self.ckpts, self.weights)):
            if i == self.anchor:
                vals = own
            else:
                vals = {n: c.get(n, check=False) for n in names}
                al = self.alignments[i]
                if al is not None:
                    vals = vals | move(al.report_b, al.elements, vals, own, dtype=self.work_dtype)
            for n in names:
                acc[n].add_(vals[n].to(acc[n].dtype), alpha=float(w))
        out = {}
        for n, v in acc.items():
            if not bool(torch.isfinite(v).all()):
                for c in self.ckpts:
                    for m in names:
                        c.get(m)  # raises naming the checkpoint and the tensor
                raise InputError(f"the merged tensor {n!r} is not finite (the inputs are); expected "
                                 "weights whose average stays within the dtype's range")
            out[n] = v.to(own[n].dtype)
        return out


class _ShardWriter:
    """The output shards, written one tensor at a time.

    The tensors, their order, shapes and dtypes are known before any value (the anchor's
    checkpoint), so each shard's safetensors header is written first and every tensor is
    appended as it is computed: memory holds one tensor, not a shard (``save_file`` would
    build the whole shard in memory). Shards hold at most ``limit`` bytes (a larger tensor
    gets its own) and are named and indexed as ``save_pretrained`` names them (one
    ``model.safetensors`` when everything fits one). Files are read back by ``safe_open``.
    """

    def __init__(self, directory, limit, plan):
        self.dir = directory
        shards, cur, size = [], [], 0
        for key, shape, dtype in plan:
            n = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
            if cur and size + n > limit:
                shards.append(cur)
                cur, size = [], 0
            cur.append((key, tuple(shape), dtype, n))
            size += n
        shards.append(cur)
        k = len(shards)
        self.names = [SINGLE if k == 1 else f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
        self.shards = shards
        self.shard_of = {key: i for i, sh in enumerate(shards) for key, *_ in sh}
        self.total = sum(n for sh in shards for *_, n in sh)
        self._file, self._current, self._next = None, -1, None

    def add(self, key, t):
        i = self.shard_of[key]
        if i != self._current:
            self._open(i)
        want_key, shape, dtype, n = self._next.pop(0)
        if want_key != key or tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"shard writer expected {want_key} {shape} {dtype}, got {key} "
                               f"{tuple(t.shape)} {t.dtype}")  # a bug, not bad input
        self._file.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)

    def _open(self, i):
        if self._file is not None:
            self._close_shard()
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype, n in self.shards[i]:
            header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(os.path.join(self.dir, self.names[i]), "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._current, self._next = i, list(self.shards[i])

    def _close_shard(self):
        if self._next:
            raise RuntimeError(f"shard {self.names[self._current]} is missing {self._next[0][0]}")
        self._file.close()
        self._file = None

    def close(self) -> dict:
        if self._file is not None:
            self._close_shard()
        if len(self.shards) > 1:
            weight_map = {key: self.names[i] for key, i in self.shard_of.items()}
            with open(os.path.join(self.dir, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return {"tensors": len(self.shard_of), "bytes": self.total, "shards": len(self.shards)}


_ST_NAMES = {v: k for k, v in _DTYPES.items()}


def merge_checkpoints(paths, out: str, *, weights=None, align="weights", anchor: int = 0, force: bool = False,
                      fold_norms: bool = True, max_shard_size=DEFAULT_SHARD, progress: bool = False,
                      **align_options) -> StreamingMerge:
    """Merge ``save_pretrained`` checkpoints into ``out`` without loading any model whole
    (see the module docstring); ``out`` is vetted and written atomically like ``symgraph
    merge``'s output (:func:`symgraph.output.save_atomic`). Returns the
    :class:`StreamingMerge` (``alignments``, ``timings``)."""
    from .output import check_out, save_atomic
    check_out(out, force=force, inputs=paths)
    job = StreamingMerge(paths, weights=weights, align=align, anchor=anchor, fold_norms=fold_norms,
                         max_shard_size=max_shard_size, progress=progress, **align_options)
    job.align()
    meta = {"inputs": [os.path.abspath(p) for p in paths], "mode": "streaming",
            "options": {"align": job.align_mode or "none", "method": "average",
                        "weights": [float(x) for x in job.weights]}}
    save_atomic(job.write, out, force=force, inputs=paths, meta=meta,
                tokenizer_from=paths[anchor] if os.path.isdir(paths[anchor]) else None)
    return job

"""A merge's inputs, checked once and before any work (:meth:`Inputs.check`): the output
directory vetted before a header is read, each model argument named (a local directory, a demo
name, a hub id) and the local ones' headers read, one kind of number per tensor across the
models, room for the output, the data file, and the output's shard size. Every refusal is one
line. The batches of a data file are read for a model by :func:`read_batches`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.files import check_input_file
from ..errors import InputError
from ..core.progress import note
from .loading import KeysDiffer, Layout, read_layout
from .outdir import check_out, check_space
from .sharded import Checkpoint, parse_size
from .specs import DATA_EXPECTED, check_checkpoint_dir, model_kind, read_data

__all__ = ["Inputs", "DEFAULT_SHARD", "MIN_USEFUL_ROWS", "check_paths", "local_layouts", "check_dtype_kinds",
           "input_names", "read_batches"]

DEFAULT_SHARD = 2 << 30  # bytes per output shard
MIN_USEFUL_ROWS = 32  # fewer data rows than this: warn that activation statistics are noisy


@dataclass(frozen=True)
class Inputs:
    """What a merge reads and writes, checked: ``out`` (absolute, vetted), the ``layouts`` of
    the models (None for a demo name or hub id), ``files`` (the models and the data file, which
    the output may not touch), ``anchor`` (the model whose architecture the merge has),
    ``shard`` (bytes per output file) and ``names`` (the models as the record names them:
    :func:`input_names`)."""
    out: str
    layouts: list
    files: list
    anchor: int
    shard: int
    names: list

    @classmethod
    def check(cls, models, out, *, force: bool = False, data: str | None = None, anchor: int = 0,
              max_shard_size=None) -> Inputs:
        """The inputs of a merge of ``models`` into ``out``, refused in one line, in this order,
        before any work: no output, an output that could lose data, a model that is no path,
        demo name or hub id, a checkpoint incomplete or unreadable from its headers, a tensor
        stored as a float in one model and an integer in another, too little room for the
        anchor's tensors, a data file that is missing or not a regular file."""
        if not out:
            raise InputError("merge needs an output directory; expected --out DIR (or 'out:' in the config)")
        files = list(models) + ([data] if data else [])
        out = check_out(out, force=force, inputs=files)  # before a header is read
        check_paths(models, merging=True)
        layouts = local_layouts(models)  # the headers, read once for every path
        check_dtype_kinds(layouts, models)
        if layouts[anchor] is not None:
            check_space(out, layouts[anchor].nbytes)
        shard, names = shard_size(max_shard_size, layouts[anchor]), input_names(models)
        if data:
            check_input_file(data, "data file", DATA_EXPECTED)
        return cls(out, layouts, files, anchor, shard, names)

    @property
    def local(self) -> bool:
        """Whether every model is a local checkpoint directory."""
        return all(lay is not None for lay in self.layouts)

    def open(self, models) -> list | None:
        """``models``' :class:`~.sharded.Checkpoint` s on the headers already read, or None when
        ``from_pretrained`` would rename their tensors (only it can read them)."""
        try:
            return [Checkpoint(os.path.expanduser(m), lay) for m, lay in zip(models, self.layouts)]
        except KeysDiffer:
            return None


def shard_size(given, layout: Layout | None) -> int:
    """Bytes per output file: ``given`` (bytes, or a size such as ``"2GB"``), else a sharded
    anchor's largest shard (the output sharded like the input), else :data:`DEFAULT_SHARD`."""
    if given:
        return parse_size(given)
    files = set(layout.files.values()) if layout is not None else ()
    return max(os.path.getsize(f) for f in files) if len(files) > 1 else DEFAULT_SHARD


def check_paths(specs, merging: bool = False):
    """Fail fast on a missing local path or a name that is none of a path, a demo name and an
    ``owner/name`` hub id, before loading anything (hub ids are tried when loading); ``merging``:
    warn of a local checkpoint named twice (a merge weighs it twice; compare, barrier and align
    take a model beside itself as it is)."""
    seen: dict = {}
    for i, m in enumerate(specs):
        if model_kind(m) == "local":
            path = os.path.expanduser(m)
            check_checkpoint_dir(path)
            first = seen.setdefault(os.path.realpath(path), i)
            if first != i and merging:  # allowed (mergekit allows it), but rarely meant
                note(f"models[{i}] ({m!r}) is the checkpoint models[{first}] ({specs[first]!r}) names again: "
                     "the merge weighs it twice (--weights weighs a model without repeating it)", "warning")


def local_layouts(specs) -> list:
    """The :class:`~symgraph.checkpoints.loading.Layout` of each local checkpoint directory
    (None for a demo name or hub id): the one reading of its headers every path starts from."""
    return [read_layout(os.path.expanduser(m)) if os.path.isdir(os.path.expanduser(m)) else None for m in specs]


def check_dtype_kinds(layouts, names):
    """Refuse, before any work, a tensor stored as a floating-point number in one model and as
    an integer in another (no merge can say what it should be), naming it."""
    first = next((i for i, lay in enumerate(layouts) if lay is not None), None)
    if first is None:
        return
    base = layouts[first]
    for name, lay in zip(names, layouts):
        if lay is None or lay is base:
            continue
        for k in base.keys:
            a, b = base.dtypes[k], lay.dtypes.get(k)
            if b is not None and a.is_floating_point != b.is_floating_point:
                raise InputError(f"tensor {k!r} is {str(a).removeprefix('torch.')} in {names[first]!r} but "
                                 f"{str(b).removeprefix('torch.')} in {name!r}; expected the same kind of number "
                                 "(floating point or integer) in every model")


def input_names(specs) -> list:
    """What the output's metadata records as its inputs: absolute paths for local ones."""
    return [os.path.abspath(os.path.expanduser(m)) if os.path.exists(os.path.expanduser(m)) else m
            for m in specs]


def read_batches(path: str | None, model, *, statistics: bool = True) -> list | None:
    """The batches of data file ``path`` for ``model`` (None without a file; ``path`` checked
    a regular file once, by :meth:`Inputs.check`), with a warning when ``statistics`` are taken
    on fewer than :data:`MIN_USEFUL_ROWS` rows (``seen_rows`` alone only reads which tokens occur)."""
    data = read_data(path, model) if path else None
    rows = sum(next(iter(b.values())).shape[0] for b in data) if data else 0
    if data and rows < MIN_USEFUL_ROWS and statistics:
        note(f"only {rows} row{'s' if rows != 1 else ''} of data in {path!r}; statistics from fewer than "
             f"{MIN_USEFUL_ROWS} rows are noisy (the merge goes on)", "warning")
    return data
